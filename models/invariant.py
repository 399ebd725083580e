"""Batch-invariant building blocks for the deterministic mode (CPU).

Measured with torch 2.13 on a 2-core AVX512-BF16 + AMX Xeon (see
tests/models/test_determinism.py and the runner's docstring):

- `F.linear` is not row-invariant: in fp32 a 1-row product is a
  matrix-vector kernel and 2-15 / 16+ rows take other GEMM kernels (with
  K = 1536, 63-129 rows yet another), and in bf16 more than 32 rows switch
  to AMX. Each kernel rounds differently. `tiled_linear` therefore always
  multiplies tiles of exactly `row_tile` rows (the tail padded with zeros):
  every call has one shape, so one kernel, and a row's result depends only
  on the row. A tile of `row_tile` rows is 64 bytes per input column, so
  every tile of the padded buffer starts cache-line aligned (MKL may pick
  code by alignment).
- fp32 `F.silu` / `torch.sigmoid` compute a scalar tail with other
  rounding than their vector body, so an element's result depends on where
  the thread and vector boundaries fall. `silu` is composed of `exp`
  (vectorised without a scalar tail) and exactly rounded arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def row_tile(dtype: torch.dtype) -> int:
    """Rows per GEMM call: 64 bytes of one input column (fp32 16, bf16 32)."""
    return max(1, 64 // torch.empty((), dtype=dtype).element_size())


def tiled_linear(x, product, bias, tile: int, upcast: bool = False) -> torch.Tensor:
    """`product(x) + bias` with every row computed in a `tile`-row GEMM of fixed shape;
    `product(rows, upcast)` is x W^T (layers.Linear.product), in fp32 when `upcast`."""
    rows = x.shape[0]
    padded = -(-rows // tile) * tile
    if padded == rows and x.is_contiguous() and x.data_ptr() % 64 == 0:
        buf = x
    else:
        buf = x.new_zeros(padded, x.shape[1])
        buf[:rows] = x
    # upcast: a bf16 product as fp32 sgemm on exact upcasts (CPUs without bf16 units)
    out = torch.cat([product(buf[start : start + tile], upcast) for start in range(0, padded, tile)])
    out = out[:rows]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)


def silu(x) -> torch.Tensor:
    """x * sigmoid(x) computed in fp32 from position-independent ops, in x's dtype."""
    x32 = x.float()
    return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)
