"""benchmarks/bench_codec.py runs in smoke mode and writes well-formed JSON."""

from .conftest import run_benchmark


def test_bench_codec_smoke(tmp_path):
    stdout, report = run_benchmark("bench_codec", "--smoke", json_path=tmp_path / "codec.json", timeout=60)
    assert "speedup" in stdout  # the table header
    cases = report["cases"]
    names = [case["name"] for case in cases]
    assert len(names) == len(set(names)) >= 4
    assert any("abort" in n for n in names)
    assert any("batch output" in n for n in names)
    for case in cases:
        assert {"name", "msgspec_us", "pickle_us", "speedup"} <= case.keys()
        assert case["msgspec_us"] > 0 and case["pickle_us"] > 0, case
        assert case["speedup"] > 0, case
        assert case["msgspec_bytes"] > 0 and case["pickle_bytes"] > 0, case
        assert case["name"] in stdout
