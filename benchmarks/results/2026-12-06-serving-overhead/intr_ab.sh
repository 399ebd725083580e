#!/usr/bin/env bash
# stepperf B=$B base vs dyn, with and without an intruder; ROUNDS rounds alternated
B=${B:-1}; N=${N:-300}
for r in $(seq ${ROUNDS:-2}); do
  order="base dyn"; [ $((r % 2)) = 0 ] && order="dyn base"
  for side in $order; do
    d=/tmp/p35/$side
    for intr in no yes; do
      if [ $intr = yes ]; then /work/main/.venv/bin/python /tmp/p35/intr.py & ip=$!; fi
      s0=$(awk '/^cpu /{print $9}' /proc/stat)
      line=$(cd $d && PYTHONPATH=$d /work/main/.venv/bin/python /work/main/benchmarks/results/2026-12-06-few-rows/stepperf.py $B 128 $N 2>/dev/null | tail -1)
      [ $intr = yes ] && kill $ip
      echo "r$r $side intruder=$intr steal +$(( $(awk '/^cpu /{print $9}' /proc/stat) - s0 )) | $line"
    done
  done
done
