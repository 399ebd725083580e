import json
import pathlib
import socket
import subprocess
import sys

import pytest


def free_tcp_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def thread_nice_values(pid: int) -> list[int]:
    """The nice value of each thread of process ``pid`` (field 19 of /proc/PID/task/TID/stat)."""
    values = []
    for tid in pathlib.Path(f"/proc/{pid}/task").iterdir():
        values.append(int((tid / "stat").read_text().rpartition(")")[2].split()[16]))
    return values


def child_pids(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (a server's children: its actors' processes and their spares)."""
    return {int(child) for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()}


@pytest.fixture
def tcp_address():
    return lambda: f"tcp://127.0.0.1:{free_tcp_port()}"


ROOT = pathlib.Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    """Build tercet's CPU kernels (once per machine, ~6 s) before tests start servers: else the
    first schedulers each compile them while their start-up is being timed."""
    from models import cpu_kernels

    cpu_kernels.load()


def run_benchmark(module: str, *args: str, json_path, timeout: float):
    """``python -m benchmarks.<module> *args --json json_path`` from the repository root; it must
    exit 0. Its stdout (the table) and the JSON it wrote."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args, "--json", str(json_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout, json.loads(pathlib.Path(json_path).read_text())
