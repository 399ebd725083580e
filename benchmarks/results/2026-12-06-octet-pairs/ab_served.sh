#!/usr/bin/env bash
# Served A/B: `tercet serve` (defaults) from the tree BASE (another commit's worktree, sharing this .venv) and
# from this tree, one at a time, the order reversed each round; bench_serving at each concurrency in CONC
# (128 random prompt tokens, 64 out with EOS ignored, 32 prompts); steal read from /proc/stat around each run.
#
#   BASE=/tmp/base ROUNDS=2 CONC="1 8" benchmarks/results/2026-12-06-octet-pairs/ab_served.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); WORK=$(cd "$HERE/../../.." && pwd)
BASE=${BASE:?a worktree of the base commit}; ROUNDS=${ROUNDS:-2}; OUT=${OUT:-$HERE}
steal() { awk '/^cpu /{print $9}' /proc/stat; }
for r in $(seq "$ROUNDS"); do
  order="base work"; [ $((r % 2)) = 0 ] && order="work base"
  for side in $order; do
    d=$WORK; [ "$side" = base ] && d=$BASE
    (cd "$d" && PYTHONPATH=$d setsid bash -c 'echo $$ > /tmp/ab-served-pid; exec "$0" -m serving.cli serve \
      --host 127.0.0.1 --port 30200 --log-level warning' "$WORK/.venv/bin/python" > "/tmp/ab-served-$side.log" 2>&1 &)
    for _ in $(seq 600); do curl -sf http://127.0.0.1:30200/health >/dev/null && break; sleep 0.5; done
    sleep 5
    for c in ${CONC:-1}; do
      s0=$(steal)
      line=$("$WORK/.venv/bin/python" "$WORK/benchmarks/bench_serving.py" --base-url http://127.0.0.1:30200 \
        --input-len 128 --output-len 64 --num-prompts 32 --max-concurrency "$c" --seed $((c + 1000 * r)) \
        --no-roofline --json "$OUT/served-$side-c$c-r$r.json" 2>/dev/null | grep -E "^ +$c |tokens a chunk" | paste -sd' ')
      echo "r$r $side c$c steal +$(( $(steal) - s0 )) ticks | $line" | tee -a "$OUT/served.txt"
    done
    kill -- -"$(cat /tmp/ab-served-pid)"; sleep 3
  done
done
