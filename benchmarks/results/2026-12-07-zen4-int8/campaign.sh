#!/usr/bin/env bash
# tercet (its defaults, and `--activations int8`), llama-server and vLLM's CPU backend on a Zen 4 EPYC, one server
# at a time (nothing else up), the servers' order reversed each round.
#
#   benchmarks/results/2026-12-07-zen4-int8/campaign.sh ROUNDS [CONCURRENCY...]   (default 1 8 32 64)
#
# Each run is bench_serving.py: streaming /v1/completions, 128 random prompt tokens, 64 out with EOS ignored,
# 32 prompts (64 at 64), seed = concurrency + 1000 x round. tercet: `tercet serve` with its defaults (bf16 here:
# dtype auto on a CPU with AVX512-BF16; the embedded Q4_1 GGUF kept as its codes), and tercet8 the same with
# `--activations int8`; the peers through ../shared/peers/serve.sh (llama-server on the same GGUF, 2 threads, 64
# slots; vLLM 0.32 in bf16 on the GGUF converted to safetensors). Steal is read from /proc/stat around every run.
# Writes serving-{tercet,tercet8,llama,vllm}-c{C}-r{R}.json, runs.txt, lscpu.txt, commit.txt, commands.txt here
# (OUT: elsewhere; SERVERS: another list, e.g. "tercet tercet8").
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
ROUNDS=${1:-2}; shift || true
CONC=("${@:-1 8 32 64}"); CONC=(${CONC[*]})
PEERS=${PEERS:-/work/shared/peers}
OUT=${OUT:-$HERE}
lscpu > "$OUT/lscpu.txt"
{ git rev-parse HEAD; git status --short --untracked-files=no; } > "$OUT/commit.txt"
{ echo "tercet: .venv/bin/tercet serve --host 127.0.0.1 --port 30200 --log-level warning"
  echo "tercet8: .venv/bin/tercet serve --host 127.0.0.1 --port 30204 --log-level warning --activations int8"
  echo "llama-server: $PEERS/serve.sh llama-server 30201 ($(sed -n '/llama-server)/,/;;/p' "$PEERS/serve.sh" | tr -s ' ' | tr '\n' ' '))"
  echo "vllm: $PEERS/serve.sh vllm 30203 ($(sed -n '/  vllm)/,/;;/p' "$PEERS/serve.sh" | tr -s ' ' | tr '\n' ' '))"; } > "$OUT/commands.txt"
steal() { awk '/^cpu /{print $9}' /proc/stat; }
port_of() { case $1 in tercet) echo 30200;; tercet8) echo 30204;; llama) echo 30201;; vllm) echo 30203;; esac; }
start() {
  case $1 in
    tercet) setsid .venv/bin/tercet serve --host 127.0.0.1 --port 30200 --log-level warning > /tmp/epyc-tercet.log 2>&1 &
            echo $! > /tmp/epyc-pid
            for _ in $(seq 600); do curl -sf http://127.0.0.1:30200/health >/dev/null && break; sleep 0.5; done ;;
    tercet8) setsid .venv/bin/tercet serve --host 127.0.0.1 --port 30204 --log-level warning --activations int8 \
               > /tmp/epyc-tercet8.log 2>&1 &
            echo $! > /tmp/epyc-pid
            for _ in $(seq 600); do curl -sf http://127.0.0.1:30204/health >/dev/null && break; sleep 0.5; done ;;
    llama) "$PEERS/serve.sh" llama-server 30201 > /tmp/epyc-pid ;;
    vllm) "$PEERS/serve.sh" vllm 30203 > /tmp/epyc-pid ;;
  esac
  sleep 10  # (what a start leaves running: caches written, tokenizers warmed)
}
stop() { kill -- -"$(cat /tmp/epyc-pid)" 2>/dev/null || true; sleep 3; }
for round in $(seq "$ROUNDS"); do
  order=(${SERVERS:-tercet tercet8 llama vllm}); [ $((round % 2)) = 0 ] && order=($(printf "%s\n" "${order[@]}" | tac))
  for server in "${order[@]}"; do
    start "$server"
    for c in "${CONC[@]}"; do
      n=32; [ "$c" -ge 64 ] && n=64
      s0=$(steal)
      line=$(.venv/bin/python benchmarks/bench_serving.py --base-url "http://127.0.0.1:$(port_of "$server")" \
        --input-len 128 --output-len 64 --num-prompts "$n" --max-concurrency "$c" --seed $((c + 1000 * round)) \
        --no-roofline --json "$OUT/serving-$server-c$c-r$round.json" | grep -E "^ +$c |tokens a chunk" | paste -sd' ')
      echo "r$round $server c$c steal +$(( $(steal) - s0 )) ticks | $line" | tee -a "$OUT/runs.txt"
    done
    stop
  done
done
