#!/bin/bash
# One server at a time (the other not running), base (8b3a809, worktree $BASE) and work (/work/main) alternated:
#   BASE=/tmp/p41/base ./serve_one.sh ROUNDS CONCURRENCY...
# (With both up, as serve_ab.sh runs them, c1 figures fell to ~100-120 tok/s for both and swapped order between
# runs: the idle server's background work competes on 2 cores; one at a time they are 145-215.)
R=$1; shift; OUT=$(cd "$(dirname "$0")" && pwd); BASE=${BASE:-/tmp/p41/base}
awk '/^cpu /{print "steal before", $9}' /proc/stat | tee -a $OUT/steal.txt
for r in $(seq $R); do for name in base work; do
  d=$BASE; [ $name = work ] && d=/work/main
  (cd $d && PYTHONPATH=$d exec /work/main/.venv/bin/tercet serve --host 127.0.0.1 --port 30232 --log-level warning > /tmp/tercet-serve-$name.log 2>&1) &
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:30232/health" >/dev/null && break; sleep 0.5; done
  sleep 3
  for c in "$@"; do
    n=64; [ $c -ge 64 ] && n=128; [ $c -le 8 ] && n=32
    echo -n "r$r c$c $name: "
    /work/main/.venv/bin/python /work/main/benchmarks/bench_serving.py --base-url http://127.0.0.1:30232 --input-len 128 --output-len 64 --num-prompts $n --max-concurrency $c --seed $((c + 1000 * r)) --no-roofline --json $OUT/serving-one-$name-c$c-r$r.json 2>/dev/null | tail -1 | awk '{print "out tok/s", $5, "TTFT p50", $8, "TPOT p50", $11}'
  done
  pkill -f "port 30232"; sleep 2
done; done | tee -a $OUT/serving-one.txt
awk '/^cpu /{print "steal after", $9}' /proc/stat | tee -a $OUT/steal.txt
