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


async def until_no_thread_niced(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of ``pid`` runs at nice 0. A spare's preload thread (nice 19), joined before its
    process starts the child, can stay a moment in /proc while it exits (longer on a busy host: it exits
    at nice 19); a thread that stays niced fails this after ``timeout`` (the kernel offers no event)."""
    import trio

    with trio.fail_after(timeout):
        while set(thread_nice_values(pid)) != {0}:
            await trio.sleep(0.01)


def child_pids(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (a server's children: its actors' processes and their spares)."""
    return {int(child) for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()}


@pytest.fixture
def tcp_address():
    return lambda: f"tcp://127.0.0.1:{free_tcp_port()}"


ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def spares_outlive_each_tests_server():
    """The suite opens hundreds of runtimes, one after another, in this process: each one's spare
    processes (``supervision.standby``) are kept when it stops, and the next one's scheduler and
    detokenizer start in them where they are warm (``actors.process.keep_spares``), not from a bare
    interpreter that imports torch and transformers again (~4 s of CPU each). The path is the one a
    restart after a crash takes in production; the first start of each kind, every server started as
    a subprocess, and every start whose environment differs still start bare."""
    import trio

    from actors.process import end_kept_spares, keep_spares

    previous = keep_spares(1, ignore_env=["PYTEST_CURRENT_TEST"])  # (pytest's name of the test running)
    yield
    keep_spares(previous)
    trio.run(end_kept_spares)


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
