import itertools

import msgspec
import pytest

from transports import open_hub

SCHEMES = ["inproc"]

_ports = itertools.count(0)


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
        raise AssertionError(scheme)  # tcp: the zmq transport adds its port picking

    return make


@pytest.fixture
async def hub():
    async with open_hub() as hub:
        yield hub
