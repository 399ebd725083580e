"""benchmarks/bench_transport.py --smoke runs and writes rows of the documented shape."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_transport_smoke(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_transport.py"), "--smoke", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "tercet / zmq_asyncio" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    keys = {(row["impl"], row["transport"], row["size"]) for row in rows}
    assert keys == {(impl, transport, size)
                    for impl in ("tercet", "zmq_asyncio", "blocking")
                    for transport in ("inproc", "ipc", "tcp")
                    for size in (100, 8192)}
    for row in rows:
        assert set(row) == {"impl", "transport", "size", "msgs_per_s", "rtt_p50_us", "rtt_p99_us"}
        assert row["msgs_per_s"] > 0 and 0 < row["rtt_p50_us"] <= row["rtt_p99_us"]
