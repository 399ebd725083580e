"""One side of ab_steps.py: loads the default model's runner from the tree in cwd (its defaults: fp32 here), then
for each stdin line 'R N' runs N decode steps of one sequence (a 128-token prompt) that verify a draft of R - 1
tokens (R rows a step, as a served request with its n-gram drafts; the draft is taken as rejected, so the
context grows a token a step, started again before it passes 378) and prints the N step times in seconds.
PROMPT (environment): another prompt length (the context then runs from it to it + 250)."""
import os, sys, time, torch
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30)
P = int(os.environ.get("PROMPT", 128))
prompt = [100 + (j * 7) % 30000 for j in range(P)]
table = r.kv.allocate(r.kv.pages_for(P + 320))
state = {"n": 1 << 30}
print("ready", flush=True)
for line in sys.stdin:
    R, N = map(int, line.split())
    if state["n"] + N > 250:
        state["last"] = r.step([SeqInput(prompt, table, 0, True)]).token_ids[0]
        state["n"] = 0
    times = []
    for _ in range(N):
        draft = [(state["last"] + 1 + i) % 30000 for i in range(R - 1)]
        seq = SeqInput([state["last"], *draft], table, P + state["n"], True, num_draft=R - 1)
        t0 = time.perf_counter(); state["last"] = r.step([seq]).token_ids[0]; times.append(time.perf_counter() - t0)
        state["n"] += 1
    print(" ".join(f"{t:.6f}" for t in times), flush=True)
