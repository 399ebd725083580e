"""Decode and prefill throughput of models.ModelRunner vs transformers' generate.

    python -m benchmarks.bench_model [--smoke] [--json PATH]

Each row decodes `--new-tokens` greedy tokens for `batch` prompts of equal
length, end to end (prefill included) in both engines, bf16 on CPU unless
told otherwise. transformers runs its padded `generate` with its default
cache. `--smoke` uses the tiny random model and finishes in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from models.loading import load_model, tiny_model, to_transformers
from models.runner import ModelRunner, SeqInput, generate

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        args.batches, args.new_tokens, args.prefill_len = "1,4", 8, 64
    dtype = DTYPES[args.dtype]
    loaded = tiny_model() if args.smoke else load_model(args.model)
    runner = ModelRunner(loaded, dtype=dtype)
    hf = to_transformers(loaded, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    tercet_tok_s(runner, prompts_for(loaded.tokenizer, 2, args.prompt_len), 4)  # warm up
    hf_tok_s(hf, prompts_for(loaded.tokenizer, 2, args.prompt_len), 4)
    rows = []
    print(f"{'batch':>5} {'tercet tok/s':>13} {'hf tok/s':>10} {'ratio':>6}", file=sys.stderr)
    for batch in batches:
        prompts = prompts_for(loaded.tokenizer, batch, args.prompt_len)
        ours = tercet_tok_s(runner, prompts, args.new_tokens)
        theirs = hf_tok_s(hf, prompts, args.new_tokens)
        rows.append({"batch": batch, "tercet_tok_s": round(ours, 1), "hf_tok_s": round(theirs, 1),
                     "ratio": round(ours / theirs, 2)})
        print(f"{batch:>5} {ours:>13.1f} {theirs:>10.1f} {ours / theirs:>6.2f}", file=sys.stderr)
    prefill = prefill_tok_s(runner, args.prefill_len)
    print(f"prefill {args.prefill_len} tokens: {prefill:.0f} tok/s", file=sys.stderr)
    result = {"rows": rows, "prefill_tok_s": round(prefill, 1), "prefill_len": args.prefill_len,
              "new_tokens": args.new_tokens, "dtype": args.dtype, "model": loaded.source}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
