"""benchmarks/bench_offline.py --smoke runs the three contestants and writes the documented JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_offline_smoke(tmp_path):
    out = tmp_path / "offline.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_offline", "--smoke", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "runner direct" in result.stdout and "tercet Engine" in result.stdout
    data = json.loads(out.read_text())
    assert {"tercet_tok_s", "runner_tok_s", "hf_cb_tok_s", "tercet_vs_runner", "tercet_vs_hf_cb"} <= data.keys()
    assert data["tercet_tok_s"] > 0 and data["runner_tok_s"] > 0
    assert data["tercet_vs_runner"] == pytest.approx(data["tercet_tok_s"] / data["runner_tok_s"], rel=0.01)
    assert data["hf_cb_tok_s"] > 0
    assert data["tercet_vs_hf_cb"] == pytest.approx(data["tercet_tok_s"] / data["hf_cb_tok_s"], rel=0.01)
    assert "transformers generate_batch" in result.stdout
    assert data["model"] == "tiny" and data["num_prompts"] * data["output_len"] > 0
