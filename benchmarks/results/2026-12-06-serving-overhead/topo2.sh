#!/usr/bin/env bash
# default vs detokenizer in main (ipc), alternated, defaults otherwise (spec on); CONC levels; 32 prompts
cd /work/main
for r in 1 2; do
  order="default detok-main"; [ $r = 2 ] && order="detok-main default"
  for t in $order; do
    cfg=default; [ $t = detok-main ] && cfg=/tmp/p35/detok-main.yaml
    setsid .venv/bin/python -m serving.cli serve --config $cfg --host 127.0.0.1 --port 30200 --log-level warning > /tmp/p35/srv-$t.log 2>&1 &
    pid=$!
    for _ in $(seq 600); do curl -sf http://127.0.0.1:30200/health >/dev/null && break; sleep 0.5; done; sleep 5
    for c in ${CONC:-1 8 32}; do
      bash /tmp/p35/cpu.sh > /tmp/p35/c0.txt; s0=$(awk '/^cpu /{print $9}' /proc/stat)
      line=$(.venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:30200 --input-len 128 --output-len 64 --num-prompts 32 --max-concurrency $c --seed $((1000*r+c)) --no-roofline --json /tmp/p35/topo-$t-c$c-r$r.json 2>/dev/null | tail -1)
      bash /tmp/p35/cpu.sh > /tmp/p35/c1.txt
      ovh=$(bash /tmp/p35/delta.sh /tmp/p35/c0.txt /tmp/p35/c1.txt | sort -k3 -n -r | tail -n +3 | awk '{s+=$3} END {print s}')
      echo "r$r $t c$c steal +$(( $(awk '/^cpu /{print $9}' /proc/stat) - s0 )) overhead ticks $ovh | $line"
    done
    kill -- -$pid; sleep 5
  done
done
