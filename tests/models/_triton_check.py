"""Run under TRITON_INTERPRET=1 (in a subprocess): triton kernels vs torch references."""

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import torch  # noqa: E402

from models import attention, triton_attention  # noqa: E402


def check(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(page_size * 100 + head_dim)
    num_pages, batch = 40, 3
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_ref, v_ref = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    new_k = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    new_v = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    slots = torch.tensor([3, 17, 0, 9, num_pages * page_size - 1])
    attention.store_kv(k_ref, v_ref, new_k, new_v, slots)
    triton_attention.store_kv(k_tri, v_tri, new_k, new_v, slots)
    assert torch.equal(k_ref, k_tri) and torch.equal(v_ref, v_tri), "store_kv differs"

    perm = torch.randperm(num_pages, generator=gen)
    table = perm[: batch * 10].view(batch, 10).to(torch.int32)
    lens = torch.tensor([1, 7 * page_size - 3, 10 * page_size], dtype=torch.int32)
    q = torch.randn(batch, num_heads, head_dim, generator=gen)
    want = attention.paged_decode_attention(q, k_ref, v_ref, table, lens, page_size, head_dim**-0.5)
    got = triton_attention.paged_decode_attention(q, k_ref, v_ref, table, lens, page_size, head_dim**-0.5)
    err = (want - got).abs().max().item()
    assert err < 1e-4, f"paged_decode_attention differs by {err}"


for case in [(1, 4, 2, 64), (16, 9, 3, 64), (4, 2, 2, 48)]:
    check(*case)
print("triton kernels match")
