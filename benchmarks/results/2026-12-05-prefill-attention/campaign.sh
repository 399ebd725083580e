#!/usr/bin/env bash
# The prefill attention kernel (2312609) against the one before it (da85818), alternated in one window.
#
#   benchmarks/results/2026-12-05-prefill-attention/campaign.sh BASE_WORKTREE [ROUNDS]
#
# BASE_WORKTREE: a checkout of da85818 (git worktree add /tmp/base da85818); the kernels of each tree are built
# from its own sources (the build cache is keyed by their digest). Per round, new then base:
# - bench_attention (one layer, SmolLM2's heads): decode rows at batch 64 and a 512 / 2048-token prompt attended
#   as one prefill chunk beside torch's SDPA (the base tree's kernel through this tree's benchmark script);
# - bench_model: the runner's prefill of 512 and 2048 tokens (the whole model, bf16);
# then both servers up (`python -m serving.cli serve`, defaults), bench_serving alternated: one request at a time
# with 2048-token prompts (TTFT), and 64 at a time with 128-token prompts (the side-by-side's c64).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$HERE/../../.." && pwd)
BASE=$(cd "$1" && pwd)
ROUNDS=${2:-2}
PY=$NEW/.venv/bin/python
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }
lscpu > "$HERE/lscpu.txt"
{ echo "new: $(git -C "$NEW" rev-parse HEAD)"; echo "base: $(git -C "$BASE" rev-parse HEAD)"; } > "$HERE/commit.txt"
echo "before: $(steal)" > "$HERE/steal.txt"
for r in $(seq "$ROUNDS"); do
  for tree in new base; do
    dir=$NEW; [ $tree = base ] && dir=$BASE
    echo "== round $r, $tree: bench_attention, bench_model"
    (cd "$dir" && PYTHONPATH=$dir $PY "$NEW/benchmarks/bench_attention.py" --batches 64 --rounds 5 \
       --prefill-lens 512,2048 --json "$HERE/attention-$tree-r$r.json" 2>&1 | tail -n 4)
    for n in 512 2048; do
      (cd "$dir" && $PY -m benchmarks.bench_model --batches 1 --new-tokens 8 --prefill-len $n \
         --json "$HERE/model-$tree-p$n-r$r.json" 2>&1 | grep prefill)
    done
  done
done
(cd "$NEW" && exec $PY -m serving.cli serve --host 127.0.0.1 --port 30220 --log-level warning) > /tmp/pa-new.log 2>&1 &
N=$!
(cd "$BASE" && exec $PY -m serving.cli serve --host 127.0.0.1 --port 30221 --log-level warning) > /tmp/pa-base.log 2>&1 &
B=$!
trap 'kill $N $B 2>/dev/null' EXIT
for port in 30220 30221; do for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done; done
sleep 10
for r in $(seq "$ROUNDS"); do
  for run in "1 2048 8" "64 128 64"; do
    set -- $run
    for tree in new base; do
      port=30220; [ $tree = base ] && port=30221
      echo "== round $r, $tree: concurrency $1, $2-token prompts"
      (cd "$NEW" && $PY benchmarks/bench_serving.py --base-url "http://127.0.0.1:$port" --input-len "$2" --output-len 64 \
         --num-prompts "$3" --max-concurrency "$1" --seed "$(( $1 + 1000 * r ))" --no-roofline \
         --json "$HERE/serving-$tree-c$1-in$2-r$r.json" 2>&1 | tail -n 3)
    done
  done
done
echo "after: $(steal)" >> "$HERE/steal.txt"
cat "$HERE/steal.txt"
