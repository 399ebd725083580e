#!/bin/bash
for r in $(seq $1); do for name in base work; do
  d=/tmp/p34/base; [ $name = work ] && d=/work/main
  echo "r$r $name attn: $(cd $d && PYTHONPATH=$d /work/main/.venv/bin/python /tmp/p34/attn.py 2>/dev/null | grep 'threads 2' | tr '\n' ' ')"
  echo "r$r $name step: $(cd $d && PYTHONPATH=$d /work/main/.venv/bin/python /tmp/p34/stepperf.py 1 300 200 2>/dev/null | tail -1)"
done; done
