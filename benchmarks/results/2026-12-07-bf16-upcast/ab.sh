#!/usr/bin/env bash
# bench_model in bf16 (and fp32 for reference), before (BASE tree) and after (WORK tree), alternated A B A B;
# steal ticks from /proc/stat around each run. Usage: ab.sh BASE WORK OUTDIR
set -euo pipefail
base=$1 work=$2 out=$3
steal() { awk '/^cpu /{print $9}' /proc/stat; }
for round in 1 2; do
  for side in base work; do
    tree=$base; [ $side = work ] && tree=$work
    s0=$(steal)
    (cd "$tree" && .venv/bin/python -m benchmarks.bench_model --dtype bf16 --batches 1,16 --new-tokens 32 \
        --json "$out/bf16-$side-r$round.json") > "$out/bf16-$side-r$round.txt" 2>&1
    echo "round $round $side: steal ticks $(( $(steal) - s0 ))" | tee -a "$out/steal.txt"
  done
done
(cd "$work" && .venv/bin/python -m benchmarks.bench_model --dtype fp32 --batches 1,16 --new-tokens 32 \
    --json "$out/fp32-work.json") > "$out/fp32-work.txt" 2>&1
