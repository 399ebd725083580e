"""Decode attention on CPU: the padded gather vs the bucketed torch path vs tercet's C++ kernel.

    python -m benchmarks.bench_attention [--smoke] [--json PATH] [--batches 32,64] [--page-size N]
        [--prefill-lens 512,2048]

One "step" is what the runner does for its decode rows: build the step's
gather plan once, then attend once per layer, over a paged cache with
shuffled pages and SmolLM2's shapes (9 heads, 3 KV heads, head_dim 64,
30 layers, bf16). Contexts are all equal (`equal`) or uniform in
`--spread` (`mixed`). The paths alternate within each round, so a noisy
neighbour slows them alike; the table gives the median of `--rounds`.
`kernel` is `models.cpu_kernels.paged_decode_attention` (reads the pages
in place; what the runner uses where it builds), compared with the
bucketed path, the runner's fallback.

A second table (`layouts`, kernel only) takes one cache per layer, as the
runner has, and lays each row's pages out three ways: `shuffled`; the
prompt side by side and then one page per decode step taken in turn by
every row (`interleaved`: what taking pages one at a time gives); and
every row's pages side by side (`side_by_side`: what the scheduler's
read-ahead gives, `serving/managers/batching.py`). Its ratio is against
`shuffled`, in the same round.

A third table (`prefill`, kernel only) attends one sequence's prompt of
`--prefill-lens` tokens as a prefill chunk does (every row causal, its own
K/V stored first) through the kernel, beside torch's
`scaled_dot_product_attention` (is_causal, GQA) over the same K/V gathered
contiguous, in bf16 and in fp32, alternated within each round: SDPA is the
fast, non-invariant baseline (oneDNN's flash attention, bf16 products on
AMX), the kernel keeps each row's bits whatever the chunking.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from models import cpu_kernels
from models.attention import bucketed_decode_attention, decode_buckets, decode_gather_plan, gathered_decode_attention
from models.kv_cache import pages_for

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def make_step(batch: int, contexts: list[int], page_size: int, generator):
    widths = [pages_for(n, page_size) for n in contexts]
    pages = torch.randperm(sum(widths), generator=generator).tolist()
    table = torch.zeros(batch, max(widths), dtype=torch.int32)
    for i, w in enumerate(widths):
        table[i, :w] = torch.tensor(pages[:w])
        pages = pages[w:]
    shape = (sum(widths) * page_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).bfloat16()
    v_cache = torch.randn(shape, generator=generator).bfloat16()
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).bfloat16()
    return q, k_cache, v_cache, table, torch.tensor(contexts, dtype=torch.int32)


def padded_step(q, k_cache, v_cache, table, lens, page_size, layers):
    rows, valid = decode_gather_plan(table, lens, page_size)
    for _ in range(layers):
        out = gathered_decode_attention(q, k_cache, v_cache, rows, valid, HEAD_DIM**-0.5)
    return out


def bucketed_step(q, k_cache, v_cache, table, lens, page_size, layers):
    buckets = decode_buckets(table, lens, page_size, KV_HEADS)
    for _ in range(layers):
        out = bucketed_decode_attention(q, k_cache, v_cache, buckets, HEAD_DIM**-0.5)
    return out


def kernel_step(q, k_cache, v_cache, table, lens, page_size, layers):
    for _ in range(layers):
        out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, HEAD_DIM**-0.5)
    return out


LAYOUTS = ("shuffled", "interleaved", "side_by_side")


def layout_table(batch: int, prompt: int, decoded: int, page_size: int, layout: str, generator) -> torch.Tensor:
    """[batch, pages] page ids for rows of `prompt` + `decoded` tokens laid out as `layout`."""
    per_row = pages_for(prompt + decoded, page_size)
    total = batch * per_row
    if layout == "shuffled":
        return torch.randperm(total, generator=generator).view(batch, per_row).to(torch.int32)
    if layout == "side_by_side":
        return torch.arange(total).view(batch, per_row).to(torch.int32)
    head = pages_for(prompt, page_size)
    prompts = torch.arange(batch * head).view(batch, head)
    steps = batch * head + torch.arange(batch * (per_row - head)).view(per_row - head, batch).t()
    return torch.cat([prompts, steps], 1).to(torch.int32)


def layout_ms(args, batch: int, generator) -> dict[str, float]:
    """Median ms of the kernel over `args.layers` layers, each with its own cache, per layout."""
    prompt, decoded = args.layout_contexts
    rows = batch * pages_for(prompt + decoded, args.page_size) * args.page_size
    caches = [(torch.randn(rows, KV_HEADS, HEAD_DIM, generator=generator).bfloat16(),
               torch.randn(rows, KV_HEADS, HEAD_DIM, generator=generator).bfloat16()) for _ in range(args.layers)]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).bfloat16()
    lens = torch.full((batch,), prompt + decoded, dtype=torch.int32)
    tables = {name: layout_table(batch, prompt, decoded, args.page_size, name, generator) for name in LAYOUTS}

    def step(table):
        for k, v in caches:
            cpu_kernels.paged_decode_attention(q, k, v, table, lens, args.page_size, HEAD_DIM**-0.5)

    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for table in tables.values():
        step(table)
    for _ in range(args.rounds):
        for name, table in tables.items():
            start = time.perf_counter()
            step(table)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def median_ms(args, batch: int, contexts: list[int], generator) -> dict:
    """Median step ms of each path, and the largest differences of the outputs from the padded path's."""
    step = make_step(batch, contexts, args.page_size, generator)
    paths = {"padded": padded_step, "bucketed": bucketed_step}
    if cpu_kernels.load():
        paths["kernel"] = kernel_step
    times = {name: [] for name in paths}
    for name, path in paths.items():  # warm up
        path(*step, args.page_size, 1)
    for _ in range(args.rounds):
        for name, path in paths.items():
            start = time.perf_counter()
            path(*step, args.page_size, args.layers)
            times[name].append((time.perf_counter() - start) * 1e3)
    ref = padded_step(*step, args.page_size, 1).float()
    diffs = {name: (path(*step, args.page_size, 1).float() - ref).abs().max().item() for name, path in paths.items()}
    return {name: (statistics.median(times[name]), diffs[name]) for name in paths}


def prefill_ms(args, tokens: int, generator) -> dict[str, float]:
    """One layer's attention over a `tokens`-token prompt attended as one prefill chunk: the kernel
    (pages shuffled) vs SDPA causal over the contiguous K/V in bf16 and fp32; median ms of the rounds."""
    import torch.nn.functional as F

    page_size = max(args.page_size, 16)
    q, k_cache, v_cache, table, _ = make_step(1, [tokens], page_size, generator)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).bfloat16()
    slots = (table[0].long()[:, None] * page_size + torch.arange(page_size)).flatten()[:tokens]
    k, v = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
    seq, lens = torch.zeros(tokens, dtype=torch.int32), torch.arange(1, tokens + 1, dtype=torch.int32)
    qt = q.transpose(0, 1)[None]
    calls = {
        "kernel": lambda: cpu_kernels.paged_attention(q, k_cache, v_cache, table, seq, lens, page_size,
                                                      HEAD_DIM**-0.5),
        "sdpa_bf16": lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True, enable_gqa=True),
        "sdpa_fp32": lambda: F.scaled_dot_product_attention(qt.float(), k.float(), v.float(), is_causal=True,
                                                            enable_gqa=True),
    }
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            call()
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes, a few seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--equal", type=int, default=140, help="the context of every row in `equal`")
    parser.add_argument("--spread", default="128-400", help="the context range of `mixed`")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--layout-contexts", default="128+52", metavar="PROMPT+DECODED",
                        help="the rows of the layouts table: prompt tokens + tokens decoded since")
    parser.add_argument("--prefill-lens", default="512,2048", help="the prompts of the prefill table")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.equal, args.spread, args.rounds, args.layers = "4", 20, "1-40", 2, 2
        args.layout_contexts, args.prefill_lens = "16+8", "300"
    args.layout_contexts = tuple(int(n) for n in args.layout_contexts.split("+"))
    low, high = (int(n) for n in args.spread.split("-"))
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'batch':>5} {'contexts':>9} {'padded ms':>10} {'bucketed ms':>12} {'speedup':>8} {'kernel ms':>10} "
          f"{'kernel vs bucketed':>19}", file=sys.stderr)
    for batch in (int(b) for b in args.batches.split(",")):
        spreads = {"equal": [args.equal] * batch,
                   "mixed": torch.randint(low, high + 1, (batch,), generator=generator).tolist()}
        for kind, contexts in spreads.items():
            measured = median_ms(args, batch, contexts, generator)
            (padded, _), (bucketed, diff) = measured["padded"], measured["bucketed"]
            row = {"batch": batch, "contexts": kind, "padded_ms": round(padded, 2),
                   "bucketed_ms": round(bucketed, 2), "speedup": round(padded / bucketed, 2),
                   "max_abs_diff": diff}
            line = f"{batch:>5} {kind:>9} {padded:>10.2f} {bucketed:>12.2f} {padded / bucketed:>8.2f}"
            if "kernel" in measured:
                kernel, kernel_diff = measured["kernel"]
                row.update(kernel_ms=round(kernel, 2), kernel_speedup=round(bucketed / kernel, 2),
                           kernel_max_abs_diff=kernel_diff)
                line += f" {kernel:>10.2f} {bucketed / kernel:>19.2f}"
            rows.append(row)
            print(line, file=sys.stderr)
    layouts = []
    if cpu_kernels.load():
        print(f"\n{'batch':>5} {'context':>8} " + " ".join(f"{name + ' ms':>16}" for name in LAYOUTS)
              + f" {'side by side vs shuffled':>25}", file=sys.stderr)
        for batch in (int(b) for b in args.batches.split(",")):
            ms = layout_ms(args, batch, generator)
            layouts.append({"batch": batch, **{f"{name}_ms": round(t, 2) for name, t in ms.items()},
                            "speedup": round(ms["shuffled"] / ms["side_by_side"], 2)})
            print(f"{batch:>5} {'+'.join(map(str, args.layout_contexts)):>8} "
                  + " ".join(f"{ms[name]:>16.2f}" for name in LAYOUTS)
                  + f" {ms['shuffled'] / ms['side_by_side']:>25.2f}", file=sys.stderr)
    prefill = []
    if cpu_kernels.load():
        print(f"\n{'prefill':>7} {'kernel ms':>10} {'SDPA bf16 ms':>13} {'SDPA fp32 ms':>13} {'vs bf16':>8} "
              f"{'vs fp32':>8}   (one layer)", file=sys.stderr)
        for tokens in (int(n) for n in args.prefill_lens.split(",")):
            ms = prefill_ms(args, tokens, generator)
            prefill.append({"tokens": tokens, **{f"{name}_ms": round(t, 3) for name, t in ms.items()},
                            "vs_sdpa_bf16": round(ms["sdpa_bf16"] / ms["kernel"], 2),
                            "vs_sdpa_fp32": round(ms["sdpa_fp32"] / ms["kernel"], 2)})
            print(f"{tokens:>7} {ms['kernel']:>10.2f} {ms['sdpa_bf16']:>13.2f} {ms['sdpa_fp32']:>13.2f} "
                  f"{ms['sdpa_bf16'] / ms['kernel']:>8.2f} {ms['sdpa_fp32'] / ms['kernel']:>8.2f}", file=sys.stderr)
    result = {"rows": rows, "layouts": layouts, "prefill": prefill, "layout_contexts": list(args.layout_contexts),
              "page_size": args.page_size, "rounds": args.rounds, "layers": args.layers,
              "spread": args.spread, "equal": args.equal, "threads": torch.get_num_threads()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
