#!/bin/bash
# The runner alone, base (8b3a809, a worktree at $BASE) and work (this checkout) alternated, ROUNDS rounds:
#   BASE=/tmp/p41/base benchmarks/results/2026-12-06-few-rows/campaign.sh 3
# - proj30.py 1: each decoder projection kind of all 30 layers at one row, called in turn (us a call, GB/s);
# - 2026-12-05-decode-steps/step.py B 128 N: decode steps of B rows after 128-token prompts (ms, median);
# - 2026-12-05-decode-steps/pf.py: prefill steps of 16 x 128 and 4 x 512 tokens (tok/s, best of 3);
# - bench_model --batches 1 (bf16): batch 1 against its bandwidth bound (JSON model-<t>-r<r>.json).
# Writes raw.txt here.
HERE=$(cd "$(dirname "$0")" && pwd); WORK=$(cd "$HERE/../../.." && pwd); BASE=${BASE:-/tmp/p41/base}
STEPS=$WORK/benchmarks/results/2026-12-05-decode-steps
PY=$WORK/.venv/bin/python
run() { (cd "$1" && PYTHONPATH="$1" "$PY" "${@:2}" 2>&1 | tr '\r' '\n' | grep -v "^load\|^$" | tail -1); }
awk '/^cpu /{print "steal before", $9}' /proc/stat | tee -a "$HERE/raw.txt"
for r in $(seq "${1:-3}"); do
  for t in base work; do
    d=$BASE; [ $t = work ] && d=$WORK
    { echo "$t r$r proj: $(run "$d" "$HERE/proj30.py" 1)"
      for b in 1 8 32 64; do echo "$t r$r decode: $(run "$d" "$STEPS/step.py" $b 128 $((b == 1 ? 200 : 48)))"; done
      echo "$t r$r prefill: $(run "$d" "$STEPS/pf.py" 16x128,4x512)"
      (cd "$d" && PYTHONPATH="$d" "$PY" -m benchmarks.bench_model --batches 1 --new-tokens 128 --prefill-len 128 \
          --dtype bf16 --json "$HERE/model-$t-r$r.json" 2>&1 | tr '\r' '\n' | grep -A1 "^batch" | tail -1 | sed "s/^/$t r$r model: /"); } | tee -a "$HERE/raw.txt"
  done
done
awk '/^cpu /{print "steal after", $9}' /proc/stat | tee -a "$HERE/raw.txt"
