#!/usr/bin/env bash
# Batch 1 against its bandwidth bound: bench_model in bf16 (the default on this CPU) and fp32, alternated.
#   benchmarks/results/2026-12-05-batch1-bound/campaign.sh [ROUNDS]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }
lscpu > "$HERE/lscpu.txt"; git rev-parse HEAD > "$HERE/commit.txt"
echo "before: $(steal)" > "$HERE/steal.txt"
for r in $(seq "${1:-2}"); do
  for dtype in bf16 fp32; do
    echo "== round $r, $dtype"
    .venv/bin/python -m benchmarks.bench_model --batches 1 --new-tokens 128 --prefill-len 128 --dtype $dtype \
      --json "$HERE/model-$dtype-r$r.json" 2>&1 | tail -n 3
  done
done
echo "after: $(steal)" >> "$HERE/steal.txt"
