#!/usr/bin/env bash
# A/B: tercet serve from $BASE (base) and /work/main (work), alternated; c in $CONC; SERVE_ARGS
set -euo pipefail
BASE=${BASE:-/tmp/p36/base}; ROUNDS=${ROUNDS:-2}; TAG=${TAG:-ab}
steal() { awk '/^cpu /{print $9}' /proc/stat; }
for r in $(seq $ROUNDS); do
  order="base work"; [ $((r % 2)) = 0 ] && order="work base"
  for side in $order; do
    d=/work/main; [ $side = base ] && d=$BASE
    cd $d; PYTHONPATH=$d setsid /work/main/.venv/bin/python -m serving.cli serve --host 127.0.0.1 --port 30200 --log-level warning $SERVE_ARGS > /tmp/p36/srv-$side.log 2>&1 &
    echo $! > /tmp/p36/pid; cd /tmp
    for _ in $(seq 600); do curl -sf http://127.0.0.1:30200/health >/dev/null && break; sleep 0.5; done
    sleep 5
    for c in ${CONC:-1}; do
      s0=$(steal)
      line=$(/work/main/.venv/bin/python /work/main/benchmarks/bench_serving.py --base-url http://127.0.0.1:30200 --input-len 128 --output-len 64 --num-prompts 32 --max-concurrency $c --seed $((c + 1000 * r)) --no-roofline --json /tmp/p36/$TAG-$side-c$c-r$r.json 2>/dev/null | tail -n 1)
      echo "r$r $side c$c steal +$(( $(steal) - s0 )) | $line"
    done
    kill -- -$(cat /tmp/p36/pid); sleep 3
  done
done
