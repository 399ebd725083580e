# served A/B: this tree (new, dc3bcc5) against a worktree at a1a10fe (base), run under flock; then the same with new3 base3 base4 new4
set -e
cd /work/main
OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/new1 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
cd /tmp/p34/wt/base
PYTHONPATH=/tmp/p34/wt/base OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/base1 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
PYTHONPATH=/tmp/p34/wt/base OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/base2 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
cd /work/main
OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/new2 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
# then: set -e
# then: cd /work/main
# then: OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/new3 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
# then: cd /tmp/p34/wt/base
# then: PYTHONPATH=/tmp/p34/wt/base OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/base3 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
# then: PYTHONPATH=/tmp/p34/wt/base OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/base4 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
# then: cd /work/main
# then: OUT=/work/main/benchmarks/results/2026-12-07-zen4-runs/served-ab/new4 SERVERS="tercet tercet8" benchmarks/results/2026-12-07-zen4-int8/campaign.sh 1 1 8
