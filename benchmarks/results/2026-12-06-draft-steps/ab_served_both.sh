#!/usr/bin/env bash
# Served A/B with both servers up (BASE's tree on port 30200, this tree on 30210, each `tercet serve` with its
# defaults), short runs alternated (base work, then work base) ROUNDS times at each concurrency in CONC: the
# host's drift over minutes (10-25 % this session) then falls on both alike. bench_serving: 128 random prompt
# tokens, 64 out with EOS ignored, NUM prompts a run; steal read around each run.
#
#   BASE=/tmp/base ROUNDS=6 CONC="1 8" NUM=16 benchmarks/results/2026-12-06-octet-pairs/ab_served_both.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); WORK=$(cd "$HERE/../../.." && pwd)
BASE=${BASE:?a worktree of the base commit}; ROUNDS=${ROUNDS:-6}; NUM=${NUM:-16}; OUT=${OUT:-$HERE}
steal() { awk '/^cpu /{print $9}' /proc/stat; }
port_of() { [ "$1" = base ] && echo 30200 || echo 30210; }
for side in base work; do
  d=$WORK; [ "$side" = base ] && d=$BASE
  (cd "$d" && PYTHONPATH=$d setsid bash -c 'echo $$ > /tmp/ab-both-pid-$1; exec "$0" -m serving.cli serve \
    --host 127.0.0.1 --port "$2" --log-level warning' "$WORK/.venv/bin/python" "$side" "$(port_of $side)" \
    > "/tmp/ab-both-$side.log" 2>&1 &)
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$(port_of $side)/health" >/dev/null && break; sleep 0.5; done
done
trap 'kill -- -"$(cat /tmp/ab-both-pid-base)" -"$(cat /tmp/ab-both-pid-work)" 2>/dev/null || true' EXIT
sleep 5
for c in ${CONC:-1 8}; do
  for r in $(seq "$ROUNDS"); do
    order="base work"; [ $((r % 2)) = 0 ] && order="work base"
    for side in $order; do
      s0=$(steal)
      line=$("$WORK/.venv/bin/python" "$WORK/benchmarks/bench_serving.py" --base-url "http://127.0.0.1:$(port_of $side)" \
        --input-len 128 --output-len 64 --num-prompts "$NUM" --max-concurrency "$c" --seed $((c + 1000 * r)) \
        --no-roofline --json "$OUT/both-$side-c$c-r$r.json" 2>/dev/null | grep -E "^ +$c |tokens a chunk" | paste -sd' ')
      echo "r$r $side c$c steal +$(( $(steal) - s0 )) ticks | $line" | tee -a "$OUT/both.txt"
    done
  done
done
