#!/bin/bash
# One-row steps of two trees, processes alternated A B A B (ROUNDS rounds), steal read around them:
#   benchmarks/results/2026-12-07-zen4-team/ab.sh ROUNDS "label|tree|env" ...
# Each run is the previous campaign's stepperf.py (B rows, a 100-token prompt, N steps; defaults 1 and 300).
R=$1; shift
STEP=$(cd "$(dirname "$0")/../2026-12-07-zen4-int8" && pwd)/stepperf.py
s0=$(head -1 /proc/stat)
for i in $(seq "$R"); do
  for spec in "$@"; do
    IFS='|' read -r label tree envs <<< "$spec"
    echo "$label $(cd "$tree" && env $envs PYTHONPATH="$tree" .venv/bin/python "$STEP" "${B:-1}" 100 "${N:-300}" 2>&1 | tail -1 | sed 's/.*step ms/ms/')"
  done
done
s1=$(head -1 /proc/stat)
python3 -c "
a=[int(x) for x in '''$s0'''.split()[1:]]; b=[int(x) for x in '''$s1'''.split()[1:]]
d=[y-x for x,y in zip(a,b)]; print('steal %.2f%%' % (100*d[7]/sum(d)))"
