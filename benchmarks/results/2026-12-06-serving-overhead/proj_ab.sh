#!/usr/bin/env bash
# proj30 at M rows: base vs dyn alternated
M=${M:-1}
for r in $(seq ${ROUNDS:-3}); do
  order="base dyn"; [ $((r % 2)) = 0 ] && order="dyn base"
  for side in $order; do
    d=/tmp/p35/$side; s0=$(awk '/^cpu /{print $9}' /proc/stat)
    line=$(cd $d && PYTHONPATH=$d /work/main/.venv/bin/python /work/main/benchmarks/results/2026-12-06-few-rows/proj30.py $M 2>/dev/null | tail -1)
    echo "r$r $side steal +$(( $(awk '/^cpu /{print $9}' /proc/stat) - s0 )) | $line"
  done
done
