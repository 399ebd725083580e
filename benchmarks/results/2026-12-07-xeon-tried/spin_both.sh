#!/bin/bash
# Two tercet servers up at once: default (port 30003) and GOMP_SPINCOUNT=$SPIN (30004); runs alternated A B B A per round
cd /work/main
out=$(realpath "${OUT:-.}"); mkdir -p $out
.venv/bin/python -m serving.cli serve --port 30003 > $out/serve-default.log 2>&1 &
env GOMP_SPINCOUNT=$SPIN .venv/bin/python -m serving.cli serve --port 30004 > $out/serve-spin.log 2>&1 &
for p in 30003 30004; do for i in $(seq 1 180); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$p/health 2>/dev/null | grep -q 200 && break; sleep 1; done; done
for p in 30003 30004; do .venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:$p --input-len 128 --output-len 64 --num-prompts 16 --max-concurrency 16 --warmup 2 --no-roofline > /dev/null 2>&1; done
one() {  # label port conc round
  n=$([ $3 = 64 ] && echo 128 || echo 16)
  s0=$(head -1 /proc/stat | awk '{print $9}')
  .venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:$2 --input-len 128 --output-len 64 --num-prompts $n --max-concurrency $3 --warmup 0 --no-roofline --seed $(( $3 + 1000 * $4 )) --json $out/$1-c$3-r$4.json > /dev/null 2>&1
  s1=$(head -1 /proc/stat | awk '{print $9}')
  python3 -c "import json; d=json.load(open('$out/$1-c$3-r$4.json')); print('$1 c$3 r$4', round(d['output_throughput'],1), 'tok/s, TPOT p50', round(d['tpot_ms']['p50'],2), 'steal +$((s1-s0))', 'ok', d['completed'])"
}
for r in 1 2 3; do
  for c in 64 1; do
    if [ $((r % 2)) = 1 ]; then one default 30003 $c $r; one spin 30004 $c $r; else one spin 30004 $c $r; one default 30003 $c $r; fi
  done
done | tee $out/runs.txt
pkill -f "serving.cli serve --port 3000[34]"; wait
