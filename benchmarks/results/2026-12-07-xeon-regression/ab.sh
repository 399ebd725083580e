#!/bin/bash
# base (021d2bb) vs head, bench_model alternated A B B A, steal around each run
out=$(realpath "${OUT:-.}")  # the worktrees at /tmp/p50/base and /tmp/p50/head (git worktree add)
for t in base head head base; do
  n=$(ls $out/bm-$t-*.json 2>/dev/null | wc -l); n=$((n+1))
  s0=$(head -1 /proc/stat | awk '{print $9}')
  (cd /tmp/p50/$t && PYTHONPATH=/tmp/p50/$t timeout 900 /work/main/.venv/bin/python -m benchmarks.bench_model --batches 1,8,64 --new-tokens 64 --json $out/bm-$t-$n.json 2>&1 | tr '\r' '\n' | grep -v "shard\|^ *$" | tail -6 > $out/bm-$t-$n.txt)
  s1=$(head -1 /proc/stat | awk '{print $9}')
  echo "$t $n steal +$((s1-s0))" >> $out/runs.txt
done
