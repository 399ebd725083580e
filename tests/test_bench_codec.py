"""benchmarks/bench_codec.py runs in smoke mode and writes well-formed JSON."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_codec_smoke(tmp_path):
    out = tmp_path / "codec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_codec", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "speedup" in proc.stdout  # the table header
    cases = json.loads(out.read_text())["cases"]
    names = [case["name"] for case in cases]
    assert len(names) == len(set(names)) >= 4
    assert any("abort" in n for n in names)
    assert any("batch output" in n for n in names)
    for case in cases:
        assert {"name", "msgspec_us", "pickle_us", "speedup"} <= case.keys()
        assert case["msgspec_us"] > 0 and case["pickle_us"] > 0, case
        assert case["speedup"] > 0, case
        assert case["msgspec_bytes"] > 0 and case["pickle_bytes"] > 0, case
        assert case["name"] in proc.stdout
