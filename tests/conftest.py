import socket

import pytest


def free_tcp_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def tcp_address():
    return lambda: f"tcp://127.0.0.1:{free_tcp_port()}"
