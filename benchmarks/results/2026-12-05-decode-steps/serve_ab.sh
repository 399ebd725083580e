#!/bin/bash
# The server before this session (935a417, a worktree at /tmp/p35/base) and after (this tree), both up and idle,
# alternated at each concurrency: streaming /v1/completions, 128 random prompt tokens, 64 out, 32 prompts (64 at 64).
#   serve_ab.sh ROUNDS CONCURRENCIES...
R=$1; shift
HERE=$(cd "$(dirname "$0")" && pwd)
(cd /tmp/p35/base && PYTHONPATH=/tmp/p35/base exec /work/main/.venv/bin/tercet serve --host 127.0.0.1 --port 30210 --log-level warning > /tmp/p35/serve-base.log 2>&1) &
(cd /work/main && PYTHONPATH=/work/main exec /work/main/.venv/bin/tercet serve --host 127.0.0.1 --port 30211 --log-level warning > /tmp/p35/serve-work.log 2>&1) &
trap 'pkill -f "port 3021[01]"' EXIT
for port in 30210 30211; do for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done; done
sleep 5
awk '/^cpu /{print "server A/B steal before", $9}' /proc/stat | tee -a "$HERE/steal.txt"
for r in $(seq $R); do for c in "$@"; do for port in 30210 30211; do
  n=32; [ $c -ge 64 ] && n=64
  echo -n "r$r c$c $([ $port = 30210 ] && echo base || echo work): "
  /work/main/.venv/bin/python /work/main/benchmarks/bench_serving.py --base-url http://127.0.0.1:$port --input-len 128 --output-len 64 --num-prompts $n --max-concurrency $c --seed $((c + 1000 * r)) --no-roofline --json $HERE/serving-$([ $port = 30210 ] && echo base || echo work)-c$c-r$r.json 2>/dev/null | tail -1 | awk '{print "out tok/s", $5, "TTFT p50", $8, "TPOT p50", $11}'
done; done; done | tee -a "$HERE/serving.txt"
awk '/^cpu /{print "server A/B steal after", $9}' /proc/stat | tee -a "$HERE/steal.txt"
