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


@pytest.fixture
def tcp_address():
    return lambda: f"tcp://127.0.0.1:{free_tcp_port()}"


ROOT = pathlib.Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    """Build tercet's CPU kernels (once per machine, ~6 s) before tests start servers: else the
    first schedulers each compile them while their start-up is being timed."""
    from models import cpu_kernels

    cpu_kernels.load()


# The files that take longest, longest first (seconds of a serial run on a 2-core box, from
# --durations; 2,622 s in all): .ci/test runs the suite on several pytest-xdist workers, each
# taking the next whole file when it is free (--dist loadfile --no-loadscope-reorder), so a long
# file started last would leave the other workers idle at the end. The rest keep their order.
LONGEST_FIRST = (
    "serving/test_recovery.py",  # 468 s
    "serving/test_deterministic.py",  # 252
    "serving/test_replicas.py",  # 227
    "serving/test_hostile.py",  # 192
    "test_bench_recovery.py",  # 186
    "serving/test_workers.py",  # 184
    "models/test_determinism.py",  # 133
    "serving/test_structured.py",  # 87
    "serving/test_fuzz.py",  # 85
    "serving/test_ray.py",  # 78
    "serving/test_cli.py",  # 69
)


def pytest_collection_modifyitems(config, items):
    tests = ROOT / "tests"
    missing = [name for name in LONGEST_FIRST if not (tests / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names files that are gone: {missing}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = pathlib.Path(item.path)
        return rank.get(path.relative_to(tests).as_posix() if path.is_relative_to(tests) else "", len(rank))

    items.sort(key=key)  # stable: a file's tests keep their order


def run_benchmark(module: str, *args: str, json_path, timeout: float):
    """``python -m benchmarks.<module> *args --json json_path`` from the repository root; it must
    exit 0. Its stdout (the table) and the JSON it wrote."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args, "--json", str(json_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout, json.loads(pathlib.Path(json_path).read_text())
