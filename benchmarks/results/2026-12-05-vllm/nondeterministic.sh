#!/usr/bin/env bash
# After campaign.sh: tercet with deterministic inference off (oneDNN's products: AMX bf16 on this CPU) and vLLM
# alternated at 32 and 64 concurrent requests, rounds 3 and 4 of campaign.sh's seeds (prompts new to both).
#
#   benchmarks/results/2026-12-05-vllm/nondeterministic.sh
#
# Writes serving-{tercet-nondet,vllm}-c{C}-r{R}.json and steal-nondet.txt here.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
P=${PEERS_DIR:-$HOME/.cache/tercet-peers}
TERCET_CMD=(.venv/bin/tercet serve --host 127.0.0.1 --port 30204 --log-level warning --disable-deterministic-inference)
VLLM_ENV=(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=2
          VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )))
VLLM_CMD=("$P/venv-vllm/bin/python" -m vllm.entrypoints.launchers.api_server.entry --model "$P/smollm2_hf"
          --served-model-name smollm2 --dtype bfloat16 --host 127.0.0.1 --port 30203 --max-model-len 2048
          --max-num-seqs 64 --enforce-eager)
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }
echo "tercet-nondet: ${TERCET_CMD[*]}" >> "$HERE/commands.txt"
"${TERCET_CMD[@]}" > /tmp/campaign-tercet-nondet.log 2>&1 &
TERCET=$!
env "${VLLM_ENV[@]}" setsid "${VLLM_CMD[@]}" < /dev/null > /tmp/campaign-vllm2.log 2>&1 &
VLLM=$!
trap 'kill $TERCET 2>/dev/null; kill -- -$VLLM 2>/dev/null || kill $VLLM 2>/dev/null' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:30204/health" >/dev/null && break; sleep 0.5; done
for _ in $(seq 600); do curl -sf "http://127.0.0.1:30203/v1/models" >/dev/null && break; sleep 0.5; done
sleep 20
port_of() { case $1 in tercet-nondet) echo 30204;; vllm) echo 30203;; esac; }
echo "before: $(steal)" > "$HERE/steal-nondet.txt"
for round in 3 4; do
  for c in 32 64; do
    for server in tercet-nondet vllm; do
      n=32; [ "$c" = 64 ] && n=64
      echo "== round $round, concurrency $c, $server"
      .venv/bin/python benchmarks/bench_serving.py --base-url "http://127.0.0.1:$(port_of $server)" --input-len 128 \
        --output-len 64 --num-prompts "$n" --max-concurrency "$c" --seed "$(( c + 1000 * round ))" --no-roofline \
        --json "$HERE/serving-$server-c$c-r$round.json" | tail -n 1
    done
  done
done
echo "after: $(steal)" >> "$HERE/steal-nondet.txt"
cat "$HERE/steal-nondet.txt"
