"""Batch-1 decode of the embedded SmolLM2 in the runner: bf16 (the default on CPUs with bf16 units) against
fp32 (whose projections are the GGUF's nibble-packed block codes), alternated A B A B in one process.

    python benchmarks/results/2026-12-05-batch1-dtype/batch1_ab.py --json PATH
"""

import argparse
import json
import os
import subprocess
import time

import torch

from models.loading import load_model
from models.runner import ModelRunner, generate


def steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    loaded = load_model(None)
    runners = {name: ModelRunner(loaded, dtype=dtype) for name, dtype in (("bf16", torch.bfloat16),
                                                                           ("fp32", torch.float32))}
    prompts = [list(range(100, 132))]  # 32 tokens
    for runner in runners.values():
        generate(runner, prompts, 16)  # warm-up
    before, load = steal(), os.getloadavg()[0]
    results = []
    print(f"{'round':>5} {'dtype':>5} {'tok/s':>7} {'ms/token':>9}")
    for r in range(args.rounds):
        for name, runner in runners.items():
            start = time.perf_counter()
            generate(runner, prompts, args.new_tokens)
            wall = time.perf_counter() - start
            results.append({"round": r, "dtype": name, "tok_s": args.new_tokens / wall,
                            "ms_per_token": wall / args.new_tokens * 1e3})
            print(f"{r:>5} {name:>5} {results[-1]['tok_s']:>7.1f} {results[-1]['ms_per_token']:>9.2f}")
    mean = {n: sum(x["tok_s"] for x in results if x["dtype"] == n) / args.rounds for n in runners}
    print(f"fp32 / bf16: {mean['fp32'] / mean['bf16']:.2f}x; steal ticks {before} -> {steal()}, load {load:.2f}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "results": results, "mean_tok_s": mean, "steal_before": before,
                       "steal_after": steal(), "loadavg_1m": load, "threads": torch.get_num_threads()}, f, indent=1)


if __name__ == "__main__":
    main()
