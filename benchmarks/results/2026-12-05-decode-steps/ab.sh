#!/usr/bin/env bash
# The runner before this session's kernel changes (BASE, a worktree of 935a417) and after (WORK), alternated
# (base, work) ROUNDS times in one window; every line of output is kept in raw.txt, then results.json.
#
#   benchmarks/results/2026-12-05-decode-steps/ab.sh BASE WORK [ROUNDS]
#
# step.py: decode steps of B rows after 128-token prompts (the runner's own step(), sampling included);
# att.py: decode attention alone, 64 rows at 160 keys, one cache per layer (30); pf.py: prefill steps
# (N prompts of L tokens in one step). Each script runs with PYTHONPATH and cwd at its tree (so that the
# tree's own models/ is imported and its kernels built).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=$(cd "$1" && pwd); WORK=$(cd "$2" && pwd); ROUNDS=${3:-3}
PY=${PY:-$WORK/.venv/bin/python}
run() { (cd "$1" && PYTHONPATH="$1" "$PY" "$HERE/$2" "${@:3}" 2>/dev/null | tail -1); }
steal() { awk '/^cpu /{print "user", $2, "system", $4, "idle", $5, "steal", $9}' /proc/stat; }
{ echo "before: $(steal)"; } > "$HERE/steal.txt"
: > "$HERE/raw.txt"
for r in $(seq "$ROUNDS"); do
  for tree in base work; do
    dir=$BASE; [ "$tree" = work ] && dir=$WORK
    for b in 64 16 8 4; do echo "r$r $tree step $(run "$dir" step.py "$b" 128 40)" | tee -a "$HERE/raw.txt"; done
    echo "r$r $tree att $(run "$dir" att.py 64 160 30 20)" | tee -a "$HERE/raw.txt"
    echo "r$r $tree prefill $(run "$dir" pf.py 1x128,8x128,16x128,1x512,1x2048)" | tee -a "$HERE/raw.txt"
  done
done
echo "after: $(steal)" >> "$HERE/steal.txt"
"$PY" - "$HERE" <<'PYEOF'
import json, re, sys
here = sys.argv[1]
out = []
for line in open(f"{here}/raw.txt"):
    rnd, tree, kind, rest = line.split(" ", 3)
    rec = {"round": int(rnd[1:]), "tree": tree, "kind": kind, "text": rest.strip()}
    if kind == "step":
        m = re.search(r"B=(\d+) P=(\d+): step ms median ([\d.]+) min ([\d.]+) tok/s (\d+)", rest)
        rec.update(rows=int(m[1]), prompt=int(m[2]), median_ms=float(m[3]), min_ms=float(m[4]), tok_s=int(m[5]))
    elif kind == "att":
        m = re.search(r"B=(\d+) CTX=(\d+) layers=(\d+): ([\d.]+) ms \(min ([\d.]+)\)", rest)
        rec.update(rows=int(m[1]), context=int(m[2]), layers=int(m[3]), median_ms=float(m[4]), min_ms=float(m[5]))
    else:
        rec["tok_s"] = {k: int(v) for k, v in re.findall(r"(\d+x\d+): (\d+) tok/s", rest)}
    out.append(rec)
json.dump(out, open(f"{here}/results.json", "w"), indent=1)
PYEOF
