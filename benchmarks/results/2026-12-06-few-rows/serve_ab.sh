#!/bin/bash
# base (8b3a809, worktree $BASE) and work (/work/main), both up, alternated per concurrency:
#   BASE=/tmp/p41/base [TAG=-x SERVE_ARGS="--speculative none"] ./serve_ab.sh ROUNDS CONCURRENCY...
R=$1; shift; OUT=$(cd "$(dirname "$0")" && pwd); BASE=${BASE:-/tmp/p41/base}
(cd $BASE && PYTHONPATH=$BASE exec /work/main/.venv/bin/tercet serve --host 127.0.0.1 --port 30230 --log-level warning $SERVE_ARGS > /tmp/tercet-serve-base.log 2>&1) &
(cd /work/main && PYTHONPATH=/work/main exec /work/main/.venv/bin/tercet serve --host 127.0.0.1 --port 30231 --log-level warning $SERVE_ARGS > /tmp/tercet-serve-work.log 2>&1) &
trap 'pkill -f "port 3023[01]"' EXIT
for port in 30230 30231; do for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done; done
sleep 5
awk '/^cpu /{print "steal before", $9}' /proc/stat | tee -a $OUT/steal.txt
for r in $(seq $R); do for c in "$@"; do for port in 30230 30231; do
  n=64; [ $c -ge 64 ] && n=128; [ $c -le 8 ] && n=32
  name=$([ $port = 30230 ] && echo base || echo work)
  echo -n "r$r c$c $name: "
  /work/main/.venv/bin/python /work/main/benchmarks/bench_serving.py --base-url http://127.0.0.1:$port --input-len 128 --output-len 64 --num-prompts $n --max-concurrency $c --seed $((c + 1000 * r)) --no-roofline --json $OUT/serving${TAG}-$name-c$c-r$r.json 2>/dev/null | tail -1 | awk '{print "out tok/s", $5, "TTFT p50", $8, "TPOT p50", $11}'
done; done; done | tee -a $OUT/serving${TAG}.txt
awk '/^cpu /{print "steal after", $9}' /proc/stat | tee -a $OUT/steal.txt
pkill -f "port 3023[01]"
