"""benchmarks/bench_overload.py --smoke: a real `tercet serve` under more streams than it admits;
/health and /metrics keep answering, the streams past the bounds get 503, nothing is dropped."""

import pytest

from .conftest import run_benchmark

pytestmark = pytest.mark.slow  # hundreds of connections against a real server


def test_bench_overload_smoke(tmp_path):
    stdout, report = run_benchmark("bench_overload", "--smoke", json_path=tmp_path / "overload.json", timeout=600)
    assert "| /health |" in stdout and "target (p99" in stdout
    assert report["load"]["probe_failures"] == [] and report["dropped"] == 0
    outcomes = report["outcomes"]
    assert set(outcomes) <= {"completed", "refused 503"} and outcomes["refused 503"] > 0
    assert sum(outcomes.values()) == report["streams"]
    for path in ("/health", "/metrics"):
        assert report["load"][path]["count"] > 0 and report["p99_ratio_load_over_idle"][path] > 0
