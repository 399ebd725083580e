import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_model_smoke_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_model", "--smoke", "--json", str(out), "--modes", "--int8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["tercet_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["ratio"] > 0
        for mode in ("off", "torch", "int8"):  # (--int8: the tiny model's weights quantized to Q4_1 / Q8_0 first)
            assert row[f"{mode}_tok_s"] > 0 and row[f"{mode}_ratio"] > 0
    assert result["prefill_tok_s"] > 0 and result["off_prefill_tok_s"] > 0 and result["torch_prefill_tok_s"] > 0
    assert result["int8_prefill_tok_s"] > 0 and "int8/dflt" in run.stderr
    assert result["deterministic"] is True  # the default
    assert "ratio" in run.stderr and "off/dflt" in run.stderr
    # beside its speed of light (benchmarks/roofline.py, small sizes in the smoke run)
    assert "GB/s" in run.stderr and "bw bound" in run.stderr and "% bound" in run.stderr
    machine, costs = result["roofline"]["machine"], result["roofline"]["costs"]
    assert machine["bandwidth"] > 0 and machine["gemm_peak"]["fp32"] > 0
    assert costs["weight_bytes"] > 0 and costs["flops"] > 2 * costs["params"] > 0
    assert costs["context_tokens"] == result["prompt_len"] + result["new_tokens"] // 2
    for row in result["rows"]:
        bounds = row["bounds"]
        assert bounds["batch"] == row["batch"] and bounds["binds"] in ("bandwidth", "compute")
        assert bounds["bandwidth_bound_tok_s"] > 0 and bounds["compute_bound_tok_s"] > 0
        assert bounds["pct_of_bound"] == max(bounds["pct_of_bandwidth_bound"], bounds["pct_of_compute_bound"]) > 0
        for mode in ("off", "torch", "int8"):  # each mode beside its own bound, over the weights as it holds them
            assert row[f"{mode}_bounds"]["batch"] == row["batch"] and row[f"{mode}_bounds"]["pct_of_bandwidth_bound"] > 0
    # the bandwidth read before and after the runs, the bounds over the higher
    assert result["bounds_bandwidth"] == max(round(machine["bandwidth"]), result["bandwidth_after"]) > 0
    assert "read again after the runs" in run.stderr
