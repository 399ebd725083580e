#!/usr/bin/env bash
# K in chunks for the AMX tiles: ca2cde0 (base, a worktree at $BASE) against this tree (work), alternated.
#   BASE=/tmp/p36/base benchmarks/results/2026-12-05-amx-k-chunks/campaign.sh ROUNDS
# projections.py: SmolLM2's four decoder projections (from the GGUF codes and from bf16 panels) at 512-2048 rows;
# ../2026-12-05-decode-steps/pf.py: runner prefill steps; its step.py: a 64-row decode step; then onednn_shape.py: gate_up's shape, tercet's
# tiles against torch's oneDNN, 1 and 2 threads (work only). Text to raw.txt, parsed to results.json.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); WORK=$(cd "$HERE/../../.." && pwd); PY=$WORK/.venv/bin/python
steal() { awk '/^cpu /{print $9}' /proc/stat; }
echo "runner campaign steal before $(steal)" >> "$HERE/steal.txt"
: > "$HERE/raw.txt"
for r in $(seq "${1:-3}"); do
  for t in base work; do
    d=$BASE; [ $t = work ] && d=$WORK
    {
      echo "== $t r$r"
      (cd "$d" && PYTHONPATH=$d $PY "$HERE/projections.py" 512,1024,2048 2>&1 | grep -oE "m=[0-9]+: codes [0-9.]+ ms.*panels [0-9.]+ ms.*" | grep -v "^  ")
      (cd "$d" && PYTHONPATH=$d $PY "$HERE/../2026-12-05-decode-steps/pf.py" 16x128,4x512,1x2048 2>&1 | tail -1 | sed 's/.*\r//')
      (cd "$d" && PYTHONPATH=$d $PY "$HERE/../2026-12-05-decode-steps/step.py" 64 128 30 2>&1 | tail -1 | grep -oE "B=64.*")
    } | tee -a "$HERE/raw.txt"
  done
done
for T in 1 2; do
  (cd "$WORK" && T=$T $PY "$HERE/onednn_shape.py" 512,1024,2048 3072 576 2>&1 | tail -1 | sed "s/^/threads $T: /") | tee -a "$HERE/raw.txt"
done
echo "runner campaign steal after $(steal)" >> "$HERE/steal.txt"
$PY - "$HERE" <<'PY'
import json, re, sys
here = sys.argv[1]; out = {"runs": [], "onednn_shape": []}; cur = None
for line in open(f"{here}/raw.txt"):
    if m := re.match(r"== (\w+) r(\d+)", line):
        cur = {"tree": m[1], "round": int(m[2]), "projections_ms": {}, "prefill_tok_s": {}}; out["runs"].append(cur)
    elif m := re.match(r"threads (\d): .*?: (.*)", line):
        out["onednn_shape"].append({"threads": int(m[1]), "tflops_tercet_onednn": {a: [float(b), float(c)] for a, b, c in re.findall(r"m=(\d+): ([0-9.]+) / ([0-9.]+)", m[2])}})
    elif cur is not None:
        for rows, codes, panels in re.findall(r"m=(\d+): codes ([0-9.]+) ms .*?panels ([0-9.]+) ms", line):
            cur["projections_ms"][rows] = {"codes": float(codes), "panels": float(panels)}
        for spec, tok in re.findall(r"(\d+x\d+): (\d+) tok/s", line):
            cur["prefill_tok_s"][spec] = int(tok)
        if m := re.search(r"B=64 P=128: step ms median ([0-9.]+) min ([0-9.]+)", line):
            cur["decode64_ms"] = {"median": float(m[1]), "min": float(m[2])}
json.dump(out, open(f"{here}/results.json", "w"), indent=1)
PY
