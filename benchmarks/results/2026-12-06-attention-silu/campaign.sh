#!/bin/bash
# The runner alone, base (157cc24, a worktree at $BASE) and work (this checkout) alternated, ROUNDS rounds:
#   BASE=/tmp/p37/base0 benchmarks/results/2026-12-06-attention-silu/campaign.sh 3
# - att.py: decode attention alone, 64 rows x 176 keys x 30 layers' caches (260 MB), and 32 x 500;
# - 2026-12-05-decode-steps/pf.py: prefill steps of 16 x 128 and 4 x 512 tokens (tok/s, best of 3);
# - 2026-12-05-decode-steps/step.py: 48 decode steps of 64 rows after 128-token prompts (ms, median).
# Writes raw.txt here.
HERE=$(cd "$(dirname "$0")" && pwd); WORK=$(cd "$HERE/../../.." && pwd); BASE=${BASE:-/tmp/p37/base0}
STEPS=$WORK/benchmarks/results/2026-12-05-decode-steps
PY=$WORK/.venv/bin/python
run() { (cd "$1" && PYTHONPATH="$1" "$PY" "${@:2}" 2>&1 | tr '\r' '\n' | grep -v "^load\|^$" | tail -1); }
awk '/^cpu /{print "steal before", $9}' /proc/stat | tee -a "$HERE/raw.txt"
for r in $(seq "${1:-3}"); do
  for t in base work; do
    d=$BASE; [ $t = work ] && d=$WORK
    { echo "$t r$r att: $(run "$d" "$HERE/att.py" 64 176 30 20 4k)"
      echo "$t r$r att: $(run "$d" "$HERE/att.py" 32 500 30 20 4k)"
      echo "$t r$r prefill: $(run "$d" "$STEPS/pf.py" 16x128,4x512)"
      echo "$t r$r decode: $(run "$d" "$STEPS/step.py" 64 128 48)"; } | tee -a "$HERE/raw.txt"
  done
done
awk '/^cpu /{print "steal after", $9}' /proc/stat | tee -a "$HERE/raw.txt"
