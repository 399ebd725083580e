#!/bin/bash
# served A/B of the int8 mode: this tree (new) against a worktree at 173f9f3 (base, the session's start), order new base base new
set -e
R=/work/main/benchmarks/results/2026-12-07-zen4-i8-tiles/served-ab
for which in new1 base1 base2 new2; do
  if [[ $which == new* ]]; then cd /work/main; unset PYTHONPATH; else cd /tmp/p34/wt/base; export PYTHONPATH=/tmp/p34/wt/base; fi
  mkdir -p $R/$which
  OUT=$R/$which SERVERS="tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8 32
done
