"""Decode of the embedded SmolLM2 in bf16 in the runner: projections from the GGUF's block codes as
served by default where the CPU has AVX512_BF16 (`Bf16BlockCodeLinear`: the codes up to the rows
`probes.bf16_code_rows` chose at load, their bf16 panels past them) against the bf16 panels alone
(`Bf16PanelLinear`, the model built with codes=False) and, with `--all-codes`, the codes serving every
product, with `--fp32` the model in fp32 (its nibble-packed block codes: the reference of
results/2026-12-05-batch1-dtype); alternated A B ... A B ... in one process at each batch size. The
bf16 arms give the same bits (tests/models/test_bf16_codes.py); the script checks their tokens.

    python benchmarks/results/2026-12-05-bf16-codes/bf16_codes_ab.py --json PATH [--batches 1,16,64] [--all-codes] [--fp32]
"""

import argparse
import json
import os
import subprocess
import time

import torch

from models.layers import CausalLM
from models.loading import load_model
from models.runner import ModelRunner, generate


def steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def runners(loaded, all_codes: bool, fp32: bool) -> dict[str, ModelRunner]:
    codes = ModelRunner(loaded, dtype=torch.bfloat16)
    panels = ModelRunner(loaded, dtype=torch.bfloat16)
    panels.model = CausalLM(loaded.config, loaded.state_dict, torch.bfloat16, torch.device("cpu"), kernel=True,
                            codes=False, invariant=panels.deterministic, fused=panels.cpu_kernel)
    coded = [lin.codes is not None for lin in codes.model.projections()]
    print(f"codes: {sum(coded)} of {len(coded)} projections as GGUF block codes, serving products of up to "
          f"{code_rows(codes)} rows (None: all); panels: {sum(lin.codes is not None for lin in panels.model.projections())}")
    arms = {"codes": codes, "panels": panels}
    if all_codes:
        arms["all-codes"] = ModelRunner(loaded, dtype=torch.bfloat16)
        for lin in arms["all-codes"].model.projections():
            lin.serve_codes_up_to(None)
    if fp32:
        arms["fp32"] = ModelRunner(loaded, dtype=torch.float32)
    return arms


def code_rows(runner: ModelRunner) -> int | None:
    """Up to how many rows the codes serve (probes.bf16_code_rows chose it at load)."""
    return runner.model.lm_head.code_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--all-codes", action="store_true", help="an arm: the codes for every product")
    parser.add_argument("--fp32", action="store_true", help="an arm: the model in fp32 (its block codes)")
    args = parser.parse_args()
    loaded = load_model(None)
    pair = runners(loaded, args.all_codes, args.fp32)
    before, load, start_time = steal(), os.getloadavg()[0], time.time()
    results = []
    print(f"{'batch':>5} {'round':>5} {'path':>9} {'tok/s':>8} {'ms/step':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [list(range(100 + i, 132 + i)) for i in range(batch)]  # 32 tokens each
        outs = {name: generate(runner, prompts, 16) for name, runner in pair.items()}  # warm-up
        assert all(out == outs["panels"] for name, out in outs.items() if name != "fp32"), \
            "the codes gave other tokens than the panels"
        for r in range(args.rounds):
            for name, runner in pair.items():
                start = time.perf_counter()
                generate(runner, prompts, args.new_tokens)
                wall = time.perf_counter() - start
                results.append({"batch": batch, "round": r, "path": name, "tok_s": batch * args.new_tokens / wall,
                                "ms_per_step": wall / args.new_tokens * 1e3})
                print(f"{batch:>5} {r:>5} {name:>9} {results[-1]['tok_s']:>8.1f} {results[-1]['ms_per_step']:>8.2f}",
                      flush=True)
    mean = {f"{b}/{n}": sum(x["tok_s"] for x in results if x["batch"] == b and x["path"] == n) / args.rounds
            for b in sorted({x["batch"] for x in results}) for n in pair}
    print("mean tok/s:", {k: round(v, 1) for k, v in mean.items()})
    print(f"steal ticks {before} -> {steal()}, load {load:.2f} -> {os.getloadavg()[0]:.2f}, "
          f"{time.time() - start_time:.0f} s")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "code_rows": code_rows(pair["codes"]), "results": results, "mean_tok_s": mean, "steal_before": before,
                       "steal_after": steal(), "loadavg_1m_before": load, "loadavg_1m_after": os.getloadavg()[0],
                       "threads": torch.get_num_threads(), "new_tokens": args.new_tokens}, f, indent=1)


if __name__ == "__main__":
    main()
