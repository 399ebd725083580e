#!/bin/bash
# abp.sh ROUNDS: proj30 at 1 row, base/work alternated
for r in $(seq $1); do for name in base work; do
  d=/tmp/p34/base; [ $name = work ] && d=/work/main
  echo "r$r $name $(cd $d && PYTHONPATH=$d /work/main/.venv/bin/python /tmp/p34/proj30.py 1 2>/dev/null | tail -1)"
done; done
