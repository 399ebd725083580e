#!/bin/bash
# perfrun.sh OUT.data args... : perf only around the decode steps
out=$1; shift
rm -f /tmp/p41/ctl; mkfifo /tmp/p41/ctl
PERF_CTL=/tmp/p41/ctl perf record -e cpu-clock -F 4000 -D -1 --control fifo:/tmp/p41/ctl -o $out -- python /tmp/p41/stepperf.py "$@"
