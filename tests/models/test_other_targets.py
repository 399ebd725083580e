"""The kernels' paths for older CPUs, built and tested on a newer host.

The kernels are built for the host (-march=native), so an AVX-512 host runs only the AVX-512 paths
and an AVX2 host only the AVX2 ones: a change made on one kind of machine could break the other's
paths unseen (the AMX Xeon's CI once found bf16 tests the EPYC had skipped failing). An AVX-512
host can run AVX2 code, so there the kernel tests run again against a build for x86-64-v3 (AVX2 +
FMA + F16C: the EPYC's paths, octets included), in a process of its own. The other way round needs
hardware the AVX2 host lacks.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]

AVX2_TARGET = "x86-64-v3"
KERNEL_TESTS = ["test_nibble_codes.py", "test_cpu_kernels.py", "test_gemm.py", "test_attention.py",
                "test_decoder.py", "test_determinism.py", "test_int8_activations.py"]
# int8 activations (csrc/gemm_i8.cpp): a product whose bits both builds must give (AVX2's vpmaddubsw, the host's
# VNNI where it has it: the same integers, the same fp32 roundings)
INT8_PRODUCT = ("import sys, hashlib, torch; sys.path.insert(0, 'tests/models'); from gguf_weights import quantized; "
                "from models import cpu_kernels as c; from models.projections import int8_block_codes; c.load(); "
                "x = torch.randn(70, 576, generator=torch.Generator().manual_seed(7)); "
                "ys = [c.i8_block_linear(x, *int8_block_codes(quantized(200, 576, kind)), 200) for kind in ('q4_1', 'q8_0')]; "
                "print(hashlib.sha256(b''.join(y.numpy().tobytes() for y in ys)).hexdigest())")

@pytest.mark.slow  # a build of its own (~25 s the first time on a machine), then ~35 s of tests
@pytest.mark.skipif("avx512f" not in cpu_kernels._cpu_flags().split(),
                    reason="the host has no AVX-512: its own build is the AVX2 one, which the suite tests")
def test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_host():
    env = {**os.environ, cpu_kernels.MARCH_ENV: AVX2_TARGET}
    which = ("from models import cpu_kernels as c; "
             "print(c.load(), c.octet_codes_preferred(), c.bf16_linear_available())")
    built = subprocess.run([sys.executable, "-c", which], capture_output=True, text=True, timeout=570, env=env,
                           cwd=ROOT)
    # loaded, the AVX2 build's own layout (octets), no AVX512_BF16 kernel: the older target, not the host's
    assert built.stdout.split() == ["True", "True", "False"], built.stderr[-2000:]
    products = [subprocess.run([sys.executable, "-c", INT8_PRODUCT], capture_output=True, text=True, timeout=300,
                               env=e, cwd=ROOT) for e in (env, os.environ)]
    assert products[0].stdout == products[1].stdout and len(products[0].stdout) == 65, [p.stderr[-1000:] for p in products]
    tests = [str(ROOT / "tests" / "models" / name) for name in KERNEL_TESTS]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                         capture_output=True, text=True, timeout=570, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]


def test_a_march_that_is_no_name_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_kernels.MARCH_ENV, "native -fplugin=/tmp/x.so")
    with pytest.raises(ValueError, match="TERCET_CPU_MARCH='native -fplugin=/tmp/x.so': not a -march name"):
        cpu_kernels.cflags()
    monkeypatch.setenv(cpu_kernels.MARCH_ENV, AVX2_TARGET)
    assert "-march=x86-64-v3" in cpu_kernels.cflags() and "-march=native" not in cpu_kernels.cflags()
    monkeypatch.delenv(cpu_kernels.MARCH_ENV)
    assert cpu_kernels.cflags() == cpu_kernels.CFLAGS
