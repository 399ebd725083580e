"""benchmarks/bench_overload.py --smoke: a real `tercet serve` under more streams than it admits;
/health and /metrics keep answering, the streams past the bounds get 503, nothing is dropped."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # hundreds of connections against a real server

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_overload_smoke(tmp_path):
    out = tmp_path / "overload.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_overload", "--smoke", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "| /health |" in proc.stdout and "target (p99" in proc.stdout
    report = json.loads(out.read_text())
    assert report["load"]["probe_failures"] == [] and report["dropped"] == 0
    outcomes = report["outcomes"]
    assert set(outcomes) <= {"completed", "refused 503"} and outcomes["refused 503"] > 0
    assert sum(outcomes.values()) == report["streams"]
    for path in ("/health", "/metrics"):
        assert report["load"][path]["count"] > 0 and report["p99_ratio_load_over_idle"][path] > 0
