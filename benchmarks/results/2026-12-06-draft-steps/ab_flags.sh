#!/usr/bin/env bash
# Served A/B of two settings of this tree, both servers up (A on port 30220 with A_FLAGS, B on 30230 with
# B_FLAGS, each `tercet serve` otherwise with its defaults), short runs alternated (A B, then B A) ROUNDS times
# at each concurrency in CONC; WORKLOAD random (128 random prompt tokens) or lookup (chat, a ~256-token passage
# the answer repeats), 64 out with EOS ignored, NUM prompts a run; steal read around each run, and the drafts
# each server verified and accepted (/server_info) after the last.
#
#   A_FLAGS="" B_FLAGS="--speculative-num-draft 6" TAG=d6 ROUNDS=6 CONC=1 NUM=8 .../ab_flags.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); WORK=$(cd "$HERE/../../.." && pwd)
ROUNDS=${ROUNDS:-6}; NUM=${NUM:-8}; OUT=${OUT:-$HERE}; TAG=${TAG:?a name for the runs}; WORKLOAD=${WORKLOAD:-random}
steal() { awk '/^cpu /{print $9}' /proc/stat; }
port_of() { [ "$1" = A ] && echo 30220 || echo 30230; }
for side in A B; do
  flags=${A_FLAGS:-}; [ "$side" = B ] && flags=${B_FLAGS:-}
  (cd "$WORK" && setsid bash -c 'echo $$ > /tmp/ab-flags-pid-$1; port=$2; shift 2; exec "$0" -m serving.cli serve \
    --host 127.0.0.1 --port "$port" --log-level warning "$@"' "$WORK/.venv/bin/python" "$side" "$(port_of $side)" \
    $flags > "/tmp/ab-flags-$side.log" 2>&1 &)
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$(port_of $side)/health" >/dev/null && break; sleep 0.5; done
done
trap 'kill -- -"$(cat /tmp/ab-flags-pid-A)" -"$(cat /tmp/ab-flags-pid-B)" 2>/dev/null || true' EXIT
sleep 5
extra=(--input-len 128 --output-len 64)
[ "$WORKLOAD" = lookup ] && extra=(--workload lookup --endpoint chat --input-len 256 --output-len 64)
echo "# $TAG: A='${A_FLAGS:-}' B='${B_FLAGS:-}' workload $WORKLOAD, $NUM prompts a run, $(date -u +%FT%TZ)" >> "$OUT/flags.txt"
for c in ${CONC:-1}; do
  for r in $(seq "$ROUNDS"); do
    order="A B"; [ $((r % 2)) = 0 ] && order="B A"
    for side in $order; do
      s0=$(steal)
      line=$("$WORK/.venv/bin/python" "$WORK/benchmarks/bench_serving.py" --base-url "http://127.0.0.1:$(port_of $side)" \
        "${extra[@]}" --num-prompts "$NUM" --max-concurrency "$c" --seed $((c + 1000 * r)) \
        --no-roofline --json "$OUT/$TAG-$WORKLOAD-$side-c$c-r$r.json" 2>/dev/null | grep -E "^ +$c |tokens a chunk" | paste -sd' ')
      echo "$TAG $WORKLOAD r$r $side c$c steal +$(( $(steal) - s0 )) ticks | $line" | tee -a "$OUT/flags.txt"
    done
  done
done
for side in A B; do
  echo "$TAG $side server_info: $(curl -s "http://127.0.0.1:$(port_of $side)/server_info" | "$WORK/.venv/bin/python" -c \
    'import json,sys; d=json.load(sys.stdin); print({k: v for k, v in d.items() if "draft" in k or "spec" in k})')" | tee -a "$OUT/flags.txt"
done
