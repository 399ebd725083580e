import itertools
import socket

import msgspec
import pytest

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
