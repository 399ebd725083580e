"""Triton kernels vs their torch references, on CPU through TRITON_INTERPRET=1.

The interpreter must be chosen before triton is imported, so the
comparison runs in a subprocess (`_triton_check.py`).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the kernels under TRITON_INTERPRET in a child process
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_match_torch_references():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = Path(__file__).with_name("_triton_check.py")
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton kernels match" in out.stdout
