"""Run under TRITON_INTERPRET=1 (in a subprocess): triton kernels vs torch references."""

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import torch  # noqa: E402

# One thread: with two, the torch split path's first case came out 6.65e-5 away (not 3.6e-7) in ~1 of 10
# runs here, the same value each time (a thread-dependent kernel choice); with one, 0 of 24.
torch.set_num_threads(1)

from models import attention, split_attention, triton_attention  # noqa: E402
from models.batch import build_batch  # noqa: E402
from models.runner import SeqInput  # noqa: E402


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


def check_split(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int, split: int = 16) -> None:
    """The deterministic-mode kernel: near the torch split-KV path, and bitwise the same for a
    row whether it is decoded alone, decoded beside others or the last row of a prefill chunk."""
    gen = torch.Generator().manual_seed(page_size + head_dim)
    num_pages = 96 // page_size + 8
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    scale = head_dim**-0.5
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table, other = perm[: 40 // page_size + 1], perm[40 // page_size + 1 :]
    q = torch.randn(40, num_heads, head_dim, generator=gen)  # the target's query at each position

    def run(rows):  # rows: (query, page table, position)
        widest = max(len(t) for _, t, _ in rows)
        tables = torch.tensor([[*t, *([0] * (widest - len(t)))] for _, t, _ in rows], dtype=torch.int32)
        pos = torch.tensor([p for _, _, p in rows], dtype=torch.int32)
        qs = torch.stack([x for x, _, _ in rows])
        return triton_attention.split_kv_attention(qs, k_cache, v_cache, tables, pos, page_size, scale, split)

    alone = torch.cat([run([(q[p], table, p)]) for p in range(40)])
    chunk = run([(q[p], table, p) for p in range(22, 40)])  # a prefill chunk after 22 cached
    noise = [(torch.randn(num_heads, head_dim, generator=gen), other, p) for p in (3, 17, 30)]
    mixed = run([noise[0], (q[39], table, 39), *noise[1:], *[(q[p], table, p) for p in range(5)]])
    assert torch.equal(chunk, alone[22:]), "prefill rows differ from decode rows"
    assert torch.equal(mixed[1], alone[39]) and torch.equal(mixed[4:], alone[:5]), "company changes a row"
    group = split_attention.split_group(0, [table], [0], 40, page_size, split, "cpu")
    want = split_attention.split_kv_attention(q, k_cache, v_cache, group, scale)
    err = (want - alone).abs().max().item()
    assert err < 1e-5, f"split_kv_attention differs from the torch split path by {err}"

    # the runner's wiring: attend() through a deterministic plan with use_triton
    seqs = [SeqInput([1], other, 30), SeqInput([1] * 18, table, 22)]
    plans = [build_batch(seqs, page_size, "cpu", backend, split=split, kv_heads=num_kv_heads).plan
             for backend in ("triton-split", "split")]
    q_step, kv = torch.randn(19, num_heads, head_dim, generator=gen), torch.randn(19, num_kv_heads, head_dim, generator=gen)
    outs = [attention.attend(q_step, kv, kv, k_cache.clone(), v_cache.clone(), plan, scale) for plan in plans]
    err = (outs[0] - outs[1]).abs().max().item()
    assert err < 1e-5, f"attend with the triton split plan differs from the torch one by {err}"


for case in [(1, 4, 2, 64), (16, 9, 3, 64), (4, 2, 2, 48)]:
    check(*case)
for case in [(1, 4, 2, 16), (16, 4, 1, 16), (4, 2, 2, 8)]:
    check_split(*case)
print("triton kernels match")
