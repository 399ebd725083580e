#!/usr/bin/env bash
# The C++ decoder (c36d490) against the commit before it (03ffea3): batch-1 decode in the runner, alternated
# base / decoder, 4 rounds of 3 runs each, in one window.
#
#   benchmarks/results/2026-12-05-decoder/run.sh BASE_CHECKOUT DECODER_CHECKOUT
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
lscpu > "$HERE/lscpu.txt"
{ echo "base: $(git -C "$1" rev-parse HEAD)"; echo "decoder: $(git -C "$2" rev-parse HEAD)"; } > "$HERE/commit.txt"
echo "python benchmarks/results/2026-12-05-decoder/b1.py CHECKOUT LABEL (alternated, 4 rounds)" > "$HERE/commands.txt"
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }
echo "before: $(steal)" > "$HERE/steal.txt"
: > "$HERE/b1.jsonl"
for _ in 1 2 3 4; do
  .venv/bin/python "$HERE/b1.py" "$1" base 2>/dev/null | tail -n 1 >> "$HERE/b1.jsonl"
  .venv/bin/python "$HERE/b1.py" "$2" decoder 2>/dev/null | tail -n 1 >> "$HERE/b1.jsonl"
done
echo "after: $(steal)" >> "$HERE/steal.txt"
cat "$HERE/b1.jsonl"
