"""benchmarks/bench_grammar.py --smoke: both grammar backends compile the schema and walk a valid
document with batched masks; the table and the JSON report come out."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_grammar_smoke(tmp_path):
    out = tmp_path / "grammar.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_grammar", "--smoke", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "| llguidance |" in proc.stdout and "| xgrammar |" in proc.stdout
    report = json.loads(out.read_text())
    assert [r["backend"] for r in report["results"]] == ["llguidance", "xgrammar"]
    for r in report["results"]:
        assert r["compile_ms"] > 0 and r["mask_us_per_token"] > 0 and r["steps"] == report["tokens"] > 10
