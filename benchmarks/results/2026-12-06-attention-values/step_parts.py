import os, sys, time, torch, collections
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models import runner as R_
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30)
acc = collections.defaultdict(float)
def timed(name, f):
    def g(*a, **k):
        t0 = time.perf_counter(); out = f(*a, **k); acc[name] += time.perf_counter() - t0; return out
    return g
R_.build_batch = timed("build_batch", R_.build_batch)
R_.sample = timed("sample", R_.sample)
r.model.forward = timed("forward", r.model.forward)
r.model.logits = timed("logits", r.model.logits)
cpu_kernels_df = cpu_kernels.decoder_forward
import models.layers as L
L.cpu_kernels.decoder_forward = timed("decoder_forward(C++)", cpu_kernels_df)
P = int(os.environ.get("PROMPT", 128)); N = 300
prompt = [100 + (j * 7) % 30000 for j in range(P)]
table = r.kv.allocate(r.kv.pages_for(P + 2*N + 64))
last = r.step([SeqInput(prompt, table, 0, True)]).token_ids[0]
n0 = 0
for it in range(2):
    acc.clear(); ts = []
    for n in range(N):
        seq = SeqInput([last], table, P + n0, True); n0 += 1
        t0 = time.perf_counter(); last = r.step([seq]).token_ids[0]; ts.append(time.perf_counter() - t0)
    tot = sum(ts)
    print(f"pass {it}: step mean {tot/N*1e3:.3f} ms; " + ", ".join(f"{k} {v/N*1e3:.3f}" for k, v in acc.items()), flush=True)
