"""Decode and prefill throughput of models.ModelRunner vs transformers' generate.

    python -m benchmarks.bench_model [--smoke] [--json PATH] [--modes]

Each row decodes `--new-tokens` greedy tokens for `batch` prompts of equal
length, end to end (prefill included) in both engines, in the dtype the
server would pick on this CPU (`--dtype auto`: bf16 with native bf16
units, else fp32) unless told otherwise. transformers runs its padded `generate` with its default
cache. tercet runs as the server does by default: deterministic (batch-invariant).
`--int8` adds a column for the opt-in int8 activations mode (its ratio to the default).
`--modes` adds two columns, each with its ratio to the default: the runner with the
mode off (`deterministic=False`: prefill attention through SDPA, oneDNN's one-row
kernel), and the mode on the torch path (no C++ kernels: split-KV attention and
fixed row tiles, what the mode cost before the kernels took it). `--smoke` uses
the tiny random model and finishes in seconds.

Beside each row, its speed of light (`roofline.py`): the machine's read bandwidth
and GEMM peak, measured first, against the bytes and FLOPs per token of the model
as the runner holds it, K/V read at the mean context of the decode (prompt +
half the new tokens), the prompt's FLOPs spread over the new tokens: the
bandwidth bound, the compute bound, which one binds and the result as a % of it
(each mode's % of its bandwidth bound too, over the model as that mode holds it). The bandwidth is read
again after the runs and the bounds take the higher read (a shared host's moves).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from benchmarks import roofline
from models.kv_cache import DEFAULT_BUDGET_BYTES
from models.loading import load_model, tiny_model, to_transformers
from models.runner import ModelRunner, SeqInput, default_dtype, generate

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def prompts_for(tokenizer, batch: int, length: int) -> list[list[int]]:
    text = " ".join(f"Story {i}: once upon a time there was a small robot who liked tea." for i in range(64))
    ids = tokenizer(text).input_ids
    return [ids[i : i + length] for i in range(batch)]  # distinct prompts, same length


def tercet_tok_s(runner, prompts, new_tokens) -> float:
    start = time.perf_counter()
    generate(runner, prompts, new_tokens)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


@torch.inference_mode()
def hf_tok_s(model, prompts, new_tokens) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
    )
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def prefill_tok_s(runner, tokens: int, repeats: int = 3) -> float:
    prompt = list(range(100, 100 + tokens))
    best = float("inf")
    for _ in range(repeats):
        pages = runner.kv.allocate(runner.kv.pages_for(tokens))
        start = time.perf_counter()
        runner.step([SeqInput(prompt, pages)])
        best = min(best, time.perf_counter() - start)
        runner.kv.free(pages)
    return tokens / best


def kv_budget(config, dtype, tokens: int) -> int:
    """Bytes of KV cache for `tokens` tokens (at least the runner's default)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return max(DEFAULT_BUDGET_BYTES, per_token * tokens)


def quantized(loaded, layers: str = "Q4_1", head: str = "Q8_0"):
    """`loaded` with its matrices quantized as llama.cpp would (the layers `layers`, the embedding and LM head
    `head`: GGML type names) and dequantized, as tercet loads such a GGUF: weights that are exactly block codes
    (the int8 mode's; the tests' too)."""
    import dataclasses

    from gguf import GGMLQuantizationType, quants

    def requantize(name, t):
        if t.dim() != 2 or t.shape[1] % 32:
            return t
        kind = GGMLQuantizationType[head if "embed" in name or "lm_head" in name else layers]
        return torch.from_numpy(quants.dequantize(quants.quantize(t.float().numpy(), kind), kind).copy())

    return dataclasses.replace(loaded, state_dict={n: requantize(n, t) for n, t in loaded.state_dict.items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                        help="auto: what the server picks on this CPU (runner.default_dtype)")
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--modes", action="store_true",
                        help="also measure the mode off and the mode on the torch path")
    parser.add_argument("--int8", action="store_true",
                        help="also measure the opt-in int8 activations mode (a GGUF's Q4_1 / Q8_0 weights; with "
                             "--smoke the tiny model's weights quantized so first)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        args.batches, args.new_tokens, args.prefill_len = "1,4", 8, 64
    if args.dtype == "auto":
        args.dtype = {v: k for k, v in DTYPES.items()}[default_dtype(torch.device("cpu"))]
    dtype = DTYPES[args.dtype]
    machine = roofline.measure_machine(smoke=args.smoke)  # first, on a quiet process
    loaded = tiny_model() if args.smoke else load_model(args.model)
    if args.smoke and args.int8:
        loaded = quantized(loaded)
    batches = [int(b) for b in args.batches.split(",")]
    budget = kv_budget(loaded.config, dtype, max(max(batches) * (args.prompt_len + args.new_tokens), args.prefill_len))
    runner = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=budget)
    others = {}
    if args.modes:
        others["off"] = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=budget, deterministic=False)
        others["torch"] = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=budget, deterministic=True,
                                      kernels=False)
    if args.int8:
        others["int8"] = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=budget, int8_activations=True)
    context = args.prompt_len + args.new_tokens // 2
    costs = roofline.model_costs(runner, context)
    mode_costs = {name: roofline.model_costs(other, context) for name, other in others.items()}  # (as each holds W)
    print(machine.describe(), costs.describe(), sep="\n", file=sys.stderr)
    hf = to_transformers(loaded, dtype)
    for r in (runner, *others.values()):  # warm up
        tercet_tok_s(r, prompts_for(loaded.tokenizer, 2, args.prompt_len), 4)
    hf_tok_s(hf, prompts_for(loaded.tokenizer, 2, args.prompt_len), 4)
    rows = []
    for batch in batches:
        prompts = prompts_for(loaded.tokenizer, batch, args.prompt_len)
        ours = tercet_tok_s(runner, prompts, args.new_tokens)
        theirs = hf_tok_s(hf, prompts, args.new_tokens)
        row = {"batch": batch, "tercet_tok_s": round(ours, 1), "hf_tok_s": round(theirs, 1),
               "ratio": round(ours / theirs, 2)}
        for name, other in others.items():
            got = tercet_tok_s(other, prompts, args.new_tokens)
            row |= {f"{name}_tok_s": round(got, 1), f"{name}_ratio": round(got / ours, 2)}
        rows.append(row)
        print(f"batch {batch}: {ours:.1f} tok/s", file=sys.stderr)  # (the table below, beside its bounds)
    # The read bandwidth again: on a shared host it moves by half between minutes (a Zen 4 EPYC read 29-47 GB/s
    # in one hour); the bounds take the higher of the two reads, so no % is flattered by a slow one.
    after = roofline.measure_bandwidth(machine.bandwidth_bytes, 2 if args.smoke else 5)
    print(f"read again after the runs: {after / 1e9:.1f} GB/s (before: {machine.bandwidth / 1e9:.1f}); "
          f"the bounds take the higher", file=sys.stderr)
    bounding = dataclasses.replace(machine, bandwidth=max(machine.bandwidth, after))
    # a mode's % of its bandwidth bound (its compute bound needs a peak not measured: int8's products, say)
    head = "".join(f" {name + ' tok/s':>12} {name + '/dflt':>10} {'% bw':>6}" for name in others)
    print(f"{'batch':>5} {'tercet tok/s':>13} {'hf tok/s':>10} {'ratio':>6}{roofline.BOUND_HEAD}{head}",
          file=sys.stderr)
    for row in rows:
        batch, ours = row["batch"], row["tercet_tok_s"]
        row["bounds"] = roofline.bound_row(ours, costs, bounding, batch, args.prompt_len, args.new_tokens)
        line = (f"{batch:>5} {ours:>13.1f} {row['hf_tok_s']:>10.1f} {row['ratio']:>6.2f}"
                f"{roofline.bound_cells(row['bounds'])}")
        for name in others:
            got = row[f"{name}_tok_s"]
            row[f"{name}_bounds"] = roofline.bound_row(got, mode_costs[name], bounding, batch, args.prompt_len,
                                                       args.new_tokens)
            line += f" {got:>12.1f} {row[f'{name}_ratio']:>10.2f} {row[f'{name}_bounds']['pct_of_bandwidth_bound']:>5.1f}%"
        print(line, file=sys.stderr)
    prefill = prefill_tok_s(runner, args.prefill_len)
    line = f"prefill {args.prefill_len} tokens: {prefill:.0f} tok/s"
    result = {"rows": rows, "prefill_tok_s": round(prefill, 1), "prefill_len": args.prefill_len,
              "new_tokens": args.new_tokens, "dtype": args.dtype, "model": loaded.source,
              "threads": torch.get_num_threads(), "deterministic": runner.deterministic,
              "invariance": runner.invariance(), "prompt_len": args.prompt_len,
              "roofline": roofline.report(machine, costs), "bandwidth_after": round(after),
              "bounds_bandwidth": round(bounding.bandwidth)}
    for name, other in others.items():
        got = prefill_tok_s(other, args.prefill_len)
        result[f"{name}_prefill_tok_s"] = round(got, 1)
        line += f", {name} {got:.0f} tok/s ({got / prefill:.2f}x)"
    print(line, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
