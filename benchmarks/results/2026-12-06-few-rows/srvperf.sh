#!/bin/bash
# srvperf.sh DIR PORT OUT: start tercet from DIR, run c1 bench under perf -a, report
D=$1; PORT=$2; OUT=$3
(cd $D && PYTHONPATH=$D exec /work/main/.venv/bin/tercet serve --host 127.0.0.1 --port $PORT --log-level info > /tmp/p41/srv-$PORT.log 2>&1) &
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
sleep 3
/work/main/.venv/bin/python /work/main/benchmarks/bench_serving.py --base-url http://127.0.0.1:$PORT --input-len 128 --output-len 64 --num-prompts 8 --max-concurrency 1 --seed 7 --no-roofline 2>/dev/null | tail -1
perf record -a -g -F 2000 -o $OUT -- /work/main/.venv/bin/python /work/main/benchmarks/bench_serving.py --base-url http://127.0.0.1:$PORT --input-len 128 --output-len 64 --num-prompts 24 --max-concurrency 1 --seed 1001 --no-roofline 2>/dev/null | tail -1
pkill -f "port $PORT"
sleep 2
