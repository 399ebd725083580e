import os, sys, time, torch
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30)
P = int(os.environ.get("PROMPT", 128)); R = int(os.environ.get("R", 1)); N = int(os.environ.get("N", 300))
prompt = [100 + (j * 7) % 30000 for j in range(P)]
table = r.kv.allocate(r.kv.pages_for(P + N + 64))
last = r.step([SeqInput(prompt, table, 0, True)]).token_ids[0]
for it in range(2):
    ts = []
    for n in range(N):
        draft = [(last + 1 + i) % 30000 for i in range(R - 1)]
        seq = SeqInput([last, *draft], table, P + n, True, num_draft=R - 1)
        t0 = time.perf_counter(); last = r.step([seq]).token_ids[0]; ts.append(time.perf_counter() - t0)
    ts.sort(); print(f"R={R} P={P} median step {ts[len(ts)//2]*1e3:.3f} ms  mean {sum(ts)/len(ts)*1e3:.3f}", flush=True)
