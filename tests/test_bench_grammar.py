"""benchmarks/bench_grammar.py --smoke: both grammar backends compile the schema and walk a valid
document with batched masks; the table and the JSON report come out."""

from .conftest import run_benchmark


def test_bench_grammar_smoke(tmp_path):
    stdout, report = run_benchmark("bench_grammar", "--smoke", json_path=tmp_path / "grammar.json", timeout=600)
    assert "| llguidance |" in stdout and "| xgrammar |" in stdout
    assert [r["backend"] for r in report["results"]] == ["llguidance", "xgrammar"]
    for r in report["results"]:
        assert r["compile_ms"] > 0 and r["mask_us_per_token"] > 0 and r["steps"] == report["tokens"] > 10
