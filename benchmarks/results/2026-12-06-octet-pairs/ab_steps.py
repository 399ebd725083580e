"""Decode steps A/B: two long-lived runners (step_server.py in tree A and in tree B, each its own
process and kernel build), alternated in blocks of N steps (A B, then B A) in one window.

    python ab_steps.py TREE_A TREE_B ROWS BLOCKS N [--json PATH] [--server PATH]

--server: another step server (default: step_server.py here; ../2026-12-06-draft-steps/step_server.py times
one sequence verifying a draft of ROWS - 1 tokens).
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

A, B, rows, blocks, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
server = (Path(sys.argv[sys.argv.index("--server") + 1]).resolve() if "--server" in sys.argv
          else Path(__file__).resolve().parent / "step_server.py")
procs = {}
for name, tree in (("A", A), ("B", B)):
    p = subprocess.Popen([f"{tree}/.venv/bin/python", str(server)], cwd=tree, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while p.stdout.readline().strip() != "ready":
        pass
    procs[name] = p
times = {"A": [], "B": []}
ratios = []
for blk in range(blocks):
    medians = {}
    for name in ("A", "B") if blk % 2 == 0 else ("B", "A"):
        p = procs[name]
        p.stdin.write(f"{rows} {n}\n")
        p.stdin.flush()
        t = [float(v) for v in p.stdout.readline().split()]
        times[name] += t
        medians[name] = statistics.median(t)
    ratios.append(medians["A"] / medians["B"])
for p in procs.values():
    p.stdin.close()
    p.wait()
ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
p10 = {k: sorted(v)[len(v) // 10] for k, v in times.items()}
print(f"rows={rows}: A median {1e3 * ma:.2f} ms (p10 {1e3 * p10['A']:.2f}) | B median {1e3 * mb:.2f} ms "
      f"(p10 {1e3 * p10['B']:.2f}) | A/B {ma / mb:.3f} | per block A/B: median {statistics.median(ratios):.3f} "
      f"min {min(ratios):.3f} max {max(ratios):.3f}")
if out:
    Path(out).write_text(json.dumps({"tree_a": A, "tree_b": B, "rows": rows, "blocks": blocks, "steps_per_block": n,
                                     "median_ms": {"A": 1e3 * ma, "B": 1e3 * mb}, "a_over_b": ma / mb,
                                     "block_ratios": ratios, "times_s": times}, indent=1))
