import itertools
import socket

import msgspec
import pytest
import zmq

from transports import open_hub

SCHEMES = ["inproc", "ipc", "tcp"]


def free_tcp_port() -> int:
    """A port nothing listens on now (the OS picks it; a race is unlikely)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Note(msgspec.Struct, tag=True, array_like=True, gc=False):
    sender: int
    seq: int
    body: bytes = b""


@pytest.fixture(params=["ipc", "tcp"])
def wire_address(request, tmp_path):
    """An address of each kind whose messages cross a real zmq socket."""
    if request.param == "ipc":
        return f"ipc://{tmp_path}/wire.sock"
    return f"tcp://127.0.0.1:{free_tcp_port()}"


@pytest.fixture
def raw_dealer():
    """A plain pyzmq DEALER: a peer that sends whatever frames a test likes. ``make(address,
    NAME=value)`` sets zmq socket options by name (it reconnects every 10 ms unless told)."""
    context = zmq.Context()
    sockets = []

    def make(address: str, **options) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        for name, value in {"RECONNECT_IVL": 10, **options}.items():
            sock.setsockopt(getattr(zmq, name), value)
        sock.connect(address)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close(linger=0)
    context.term()


@pytest.fixture(params=SCHEMES)
def scheme(request):
    return request.param


@pytest.fixture
def make_address(scheme, tmp_path):
    names = itertools.count()

    def make() -> str:
        n = next(names)
        if scheme == "inproc":
            return f"inproc://contract-{n}"
        if scheme == "ipc":
            return f"ipc://{tmp_path}/contract-{n}.sock"
        if scheme == "tcp":
            return f"tcp://127.0.0.1:{free_tcp_port()}"
        raise AssertionError(scheme)

    return make


@pytest.fixture
async def hub():
    async with open_hub() as hub:
        yield hub
