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
        [sys.executable, "-m", "benchmarks.bench_model", "--smoke", "--json", str(out), "--modes"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["tercet_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["ratio"] > 0
        for mode in ("off", "torch"):
            assert row[f"{mode}_tok_s"] > 0 and row[f"{mode}_ratio"] > 0
    assert result["prefill_tok_s"] > 0 and result["off_prefill_tok_s"] > 0 and result["torch_prefill_tok_s"] > 0
    assert result["deterministic"] is True  # the default
    assert "ratio" in run.stderr and "off/dflt" in run.stderr
