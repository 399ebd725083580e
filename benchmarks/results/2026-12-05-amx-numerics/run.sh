#!/usr/bin/env bash
# The runner and the server with the bf16 kernels' tile numerics (AMX) against the commit before them.
#
#   benchmarks/results/2026-12-05-amx-numerics/run.sh BASE_CHECKOUT
#
# 1. bench_model (bf16 as served, batches 1/16/64, prefill 512) at BASE_CHECKOUT (a worktree of the commit
#    before, vdpbf16ps numerics) and at this checkout, one after the other;
# 2. tercet serve (this checkout, defaults) and vLLM 0.32 CPU (bf16, ../2026-12-05-vllm's flags) alternated at
#    8, 32 and 64 concurrent requests, 128-token random prompts, 64 out, seeds of round 5 (new to both).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=$1
cd "$HERE/../../.."
P=${PEERS_DIR:-$HOME/.cache/tercet-peers}
lscpu > "$HERE/lscpu.txt"
{ echo "this: $(git rev-parse HEAD)"; echo "base: $(git -C "$BASE" rev-parse HEAD)"; } > "$HERE/commit.txt"
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }
echo "before: $(steal)" > "$HERE/steal.txt"
(cd "$BASE" && "$OLDPWD/.venv/bin/python" -m benchmarks.bench_model --batches 1,16,64 --json "$HERE/bench_model-base.json")
.venv/bin/python -m benchmarks.bench_model --batches 1,16,64 --json "$HERE/bench_model-tile.json"
TERCET_CMD=(.venv/bin/tercet serve --host 127.0.0.1 --port 30200 --log-level warning)
VLLM_ENV=(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=2
          VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )))
VLLM_CMD=("$P/venv-vllm/bin/python" -m vllm.entrypoints.launchers.api_server.entry --model "$P/smollm2_hf"
          --served-model-name smollm2 --dtype bfloat16 --host 127.0.0.1 --port 30203 --max-model-len 2048
          --max-num-seqs 64 --enforce-eager)
{ echo "tercet: ${TERCET_CMD[*]}"; echo "vllm: ${VLLM_ENV[*]} ${VLLM_CMD[*]}";
  echo "bench_model: python -m benchmarks.bench_model --batches 1,16,64 --json PATH (in each checkout)"; } > "$HERE/commands.txt"
"${TERCET_CMD[@]}" > /tmp/amx-tercet.log 2>&1 &
TERCET=$!
env "${VLLM_ENV[@]}" setsid "${VLLM_CMD[@]}" < /dev/null > /tmp/amx-vllm.log 2>&1 &
VLLM=$!
trap 'kill $TERCET 2>/dev/null; kill -- -$VLLM 2>/dev/null || kill $VLLM 2>/dev/null' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:30200/health" >/dev/null && break; sleep 0.5; done
for _ in $(seq 600); do curl -sf "http://127.0.0.1:30203/v1/models" >/dev/null && break; sleep 0.5; done
sleep 15
for c in 8 32 64; do
  for server in tercet vllm; do
    port=30200; [ $server = vllm ] && port=30203
    n=32; [ "$c" = 64 ] && n=64
    echo "== concurrency $c, $server"
    .venv/bin/python benchmarks/bench_serving.py --base-url "http://127.0.0.1:$port" --input-len 128 --output-len 64 \
      --num-prompts "$n" --max-concurrency "$c" --seed "$(( c + 5000 ))" --no-roofline \
      --json "$HERE/serving-$server-c$c.json" | tail -n 1
  done
done
echo "after: $(steal)" >> "$HERE/steal.txt"
