import os, sys, time, torch, collections
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels, layers as L
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30)
m = r.model
acc = collections.defaultdict(float)
def T(name, f, *a):
    t0 = time.perf_counter(); out = f(*a); acc[name] += time.perf_counter() - t0; return out
def fused(self, x, cos, sin, plan, k_cache, v_cache):
    h = L._rms_norm(x, self.layers[0].input_norm, self.eps)
    for i, layer in enumerate(self.layers):
        qkv = T("qkv", layer.qkv, h)
        q, k = T("rope", cpu_kernels.rope_store, qkv, cos, sin, k_cache[i], v_cache[i], plan.slots, self.num_heads, self.num_kv_heads)
        v = qkv.view(len(x), -1, self.head_dim)[:, self.num_heads + self.num_kv_heads :]
        attn = T("attend", L.attend, q, k, v, k_cache[i], v_cache[i], plan, self.scale, True, layer.window)
        o = T("o", layer.o, attn.reshape(len(x), self.q_size))
        h = T("norm", cpu_kernels.add_rms_norm_, x, o, layer.post_norm, self.eps)
        gu = T("gate_up", layer.gate_up, h)
        s = T("silu", cpu_kernels.silu_mul, gu)
        down = T("down", layer.down, s)
        after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
        h = T("norm", cpu_kernels.add_rms_norm_, x, down, after, self.eps)
    return h
import inspect; print(inspect.signature(L.attend))
type(m)._fused_forward = fused
m.decoder = None
P = int(os.environ.get("PROMPT", 128)); N = 200
prompt = [100 + (j * 7) % 30000 for j in range(P)]
table = r.kv.allocate(r.kv.pages_for(P + 2*N + 64))
last = r.step([SeqInput(prompt, table, 0, True)]).token_ids[0]
n0 = 0
for it in range(2):
    acc.clear(); t0 = time.perf_counter()
    for n in range(N):
        seq = SeqInput([last], table, P + n0, True); n0 += 1
        last = r.step([seq]).token_ids[0]
    tot = (time.perf_counter() - t0) / N
    print(f"pass {it}: step {tot*1e3:.3f} ms; " + ", ".join(f"{k} {v/N*1e3:.3f}" for k, v in acc.items()), f"sum {sum(acc.values())/N*1e3:.3f}", flush=True)
