"""Offline throughput: the Engine vs the model runner driven directly vs transformers' generate_batch.

    python -m benchmarks.bench_offline [--smoke] [--json PATH] [--num-prompts N]
                                       [--input-len L] [--output-len L]

N random token-id prompts of ``--input-len`` tokens each decode exactly
``--output-len`` greedy tokens (EOS ignored) in three ways, on the same
weights and dtype:

* tercet: ``open_engine`` (inproc topology) — tokenizer manager, scheduler,
  detokenizer, all the messages between them;
* runner: ``ModelRunner.step`` driven by a plain loop that does what the
  scheduler would do at best — all N running at once, mixed steps with
  the same chunked-prefill budget — the limit for the Engine;
* hf_cb: transformers' continuous batching, ``model.generate_batch``.

Output tokens per second of each, and the ratios tercet/runner and
tercet/hf_cb. ``--smoke`` runs the tiny random model on a few prompts in
seconds. ``--skip-hf`` leaves transformers out (its JSON values are null).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time

import torch
import trio

from models.loading import load_model, tiny_model, to_transformers
from models.runner import ModelRunner, SeqInput

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def kv_budget(loaded, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of KV cache for ``tokens`` tokens, with room to spare (no retraction in a run)."""
    c = loaded.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8
    return int(per_token * tokens * 1.25) + (1 << 20)


# -- runner-direct: the best the scheduler could do -----------------------------------------


def runner_direct(runner: ModelRunner, prompts: list[list[int]], output_len: int, chunk: int) -> list[list[int]]:
    """All prompts at once: each step decodes every prefilled sequence and spends ``chunk`` prompt tokens."""
    tables = [runner.kv.allocate(runner.kv.pages_for(len(p) + output_len)) for p in prompts]
    try:
        outputs: list[list[int]] = [[] for _ in prompts]
        done = [0] * len(prompts)  # tokens with K/V computed
        while any(len(o) < output_len for o in outputs):
            batch, who, budget = [], [], chunk
            for i, p in enumerate(prompts):
                if done[i] >= len(p):
                    if len(outputs[i]) < output_len:
                        batch.append(SeqInput([outputs[i][-1]], tables[i], done[i]))
                        who.append(i)
                elif budget > 0:
                    new = p[done[i] : done[i] + budget]
                    budget -= len(new)
                    batch.append(SeqInput(new, tables[i], done[i], done[i] + len(new) == len(p)))
                    who.append(i)
            sampled = runner.step(batch).token_ids
            for i, seq, token in zip(who, batch, sampled):
                done[i] += len(seq.token_ids)
                if token is not None:
                    outputs[i].append(token)
        return outputs
    finally:
        for table in tables:
            runner.kv.free(table)


def runner_tok_s(runner, prompts, output_len, chunk) -> float:
    start = time.perf_counter()
    runner_direct(runner, prompts, output_len, chunk)
    return len(prompts) * output_len / (time.perf_counter() - start)


# -- tercet: the Engine, measured alternately with the runner ------------------------------


def tercet_and_runner_tok_s(model, runner, prompts, output_len, *, dtype, chunk, kv_budget_bytes,
                            warmup, repeats) -> tuple[float, float]:
    """Best of ``repeats`` alternating runs of each.

    The runner loop runs in a trio worker thread, as the scheduler's steps do:
    torch's intra-op threading differs between the main thread and others, and
    both sides should get the same.
    """
    from serving.runtime.engine import open_engine

    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}

    async def main() -> tuple[float, float]:
        async with open_engine(model, dtype=dtype, chunked_prefill_size=chunk, max_running_requests=len(prompts),
                               max_queued_requests=max(1024, len(prompts)), kv_budget_bytes=kv_budget_bytes,
                               enable_prefix_cache=False) as engine:
            await engine.generate(warmup, {**params, "max_new_tokens": 4})
            await trio.to_thread.run_sync(runner_direct, runner, warmup, 4, chunk)
            ours, limit = 0.0, 0.0
            for _ in range(repeats):
                limit = max(limit, await trio.to_thread.run_sync(runner_tok_s, runner, prompts, output_len, chunk))
                start = time.perf_counter()
                results = await engine.generate(prompts, params)
                ours = max(ours, len(prompts) * output_len / (time.perf_counter() - start))
                assert all(len(r["output_ids"]) == output_len for r in results), "a request ended early"
        return ours, limit

    return trio.run(main)


# -- transformers' continuous batching ----------------------------------------------------


@torch.inference_mode()
def hf_cb_tok_s(hf, prompts, output_len, chunk) -> float:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # CPU: no psutil, no eos: noise
    gen = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    page = 64
    blocks = len(prompts) * -(-(len(prompts[0]) + output_len) // page) + len(prompts)
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=chunk + len(prompts),
                                  max_requests_per_batch=len(prompts))
    hf.generate_batch(inputs=prompts[:2], generation_config=gen, continuous_batching_config=cb,
                      max_new_tokens=4)  # warm up
    start = time.perf_counter()
    results = hf.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    assert produced == len(prompts) * output_len, f"transformers produced {produced} tokens"
    return produced / elapsed


# -- the run ------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few prompts, seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--chunked-prefill-size", type=int, default=512)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many alternating runs")
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers' generate_batch")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 8, 16, 16, 1
    dtype = DTYPES[args.dtype]
    model = "tiny" if args.smoke else args.model
    loaded = tiny_model() if args.smoke else load_model(args.model)
    vocab = len(loaded.tokenizer)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    warmup = random_prompts(2, 8, vocab, seed=1)
    budget = kv_budget(loaded, dtype, args.num_prompts * (args.input_len + args.output_len) + 64)
    chunk = args.chunked_prefill_size

    runner = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=budget)
    tercet_result, runner_result = tercet_and_runner_tok_s(
        model, runner, prompts, args.output_len, dtype=str(dtype).removeprefix("torch."), chunk=chunk,
        kv_budget_bytes=budget, warmup=warmup, repeats=args.repeats)
    del runner
    hf_result = None
    if not args.skip_hf:
        hf_result = hf_cb_tok_s(to_transformers(loaded, dtype), prompts, args.output_len, chunk)

    result = {
        "tercet_tok_s": round(tercet_result, 1),
        "runner_tok_s": round(runner_result, 1),
        "hf_cb_tok_s": None if hf_result is None else round(hf_result, 1),
        "tercet_vs_runner": round(tercet_result / runner_result, 3),
        "tercet_vs_hf_cb": None if hf_result is None else round(tercet_result / hf_result, 3),
        "repeats": args.repeats, "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "chunked_prefill_size": chunk, "dtype": args.dtype, "model": loaded.source,
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, {args.dtype}, "
          f"{loaded.source}, {torch.get_num_threads()} threads")
    print(f"{'':<28} {'tok/s':>10} {'tercet / it':>12}")
    print(f"{'tercet Engine (inproc)':<28} {tercet_result:>10.1f} {1.0:>12.2f}")
    print(f"{'runner direct (limit)':<28} {runner_result:>10.1f} {tercet_result / runner_result:>12.2f}")
    if hf_result is None:
        print(f"{'transformers generate_batch':<28} {'skipped':>10} {'-':>12}")
    else:
        print(f"{'transformers generate_batch':<28} {hf_result:>10.1f} {tercet_result / hf_result:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
