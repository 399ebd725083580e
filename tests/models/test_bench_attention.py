import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_attention_smoke_writes_its_json(tmp_path):
    out = tmp_path / "attention.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_attention", "--smoke", "--page-size", "4", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(row["batch"], row["contexts"]) for row in result["rows"]] == [(4, "equal"), (4, "mixed")]
    for row in result["rows"]:
        assert row["padded_ms"] > 0 and row["bucketed_ms"] > 0 and row["speedup"] > 0
        assert row["max_abs_diff"] < 2e-2  # bf16 rounding, not another result
        if shutil.which("c++"):  # the C++ kernel, where it can be built
            assert row["kernel_ms"] > 0 and row["kernel_speedup"] > 0 and row["kernel_max_abs_diff"] < 2e-2
    assert result["page_size"] == 4 and "speedup" in run.stderr
    if shutil.which("c++"):
        [layouts] = result["layouts"]
        assert layouts["batch"] == 4 and layouts["speedup"] > 0
        assert all(layouts[f"{name}_ms"] > 0 for name in ("shuffled", "interleaved", "side_by_side"))
        assert "side by side vs shuffled" in run.stderr
        [prefill] = result["prefill"]  # a 300-token prompt: two splits of keys
        assert prefill["tokens"] == 300 and prefill["kernel_ms"] > 0
        assert prefill["sdpa_bf16_ms"] > 0 and prefill["sdpa_fp32_ms"] > 0 and prefill["vs_sdpa_fp32"] > 0
