import json
import subprocess
import sys
from pathlib import Path

from models import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gemm_smoke_prints_its_table_and_writes_its_json(tmp_path):
    out = tmp_path / "gemm.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_gemm", "--smoke", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(row["shape"], row["rows"]) for row in result["rows"]] == [("small", 1), ("small", 7)]
    assert all(row["f_linear_ms"] > 0 for row in result["rows"])
    assert result["kernel"] == cpu_kernels.packed_linear_available()
    if result["kernel"]:
        assert all(row["tercet_ms"] > 0 and row["vs_f_linear"] > 0 for row in result["rows"])
        assert all(row["codes_ms"] > 0 and row["codes_vs_tercet"] > 0 for row in result["rows"])
        assert "vs F.linear" in run.stderr
    assert result["bf16_kernel"] == cpu_kernels.bf16_linear_available()
    if result["bf16_kernel"]:
        assert all(row["bf16_ms"] > 0 and row["bf16_onednn_ms"] > 0 for row in result["rows"])
        assert "bf16 ms" in run.stderr
