"""SmolLM2's projections: the exact path as this machine's default serves it (bf16 block codes where it has bf16
units, else fp32 block codes) against int8 activations, alternated in one process, medians."""
import torch, time, sys
sys.path.insert(0,'tests/models')
from gguf_weights import quantized
from models import cpu_kernels as ck
from models.projections import Linear, int8_block_codes, Int8BlockCodeLinear
from models.runner import default_dtype
assert ck.load()
dtype = default_dtype(torch.device("cpu"))
shapes=[("qkv",960,576,"q4_1"),("o",576,576,"q4_1"),("gate_up",3072,576,"q4_1"),("down",576,1536,"q4_1"),("head",49152,576,"q8_0")]
rows=[int(r) for r in sys.argv[1].split(",")] if len(sys.argv)>1 else [1,2,4,8,64,512]
def t(f, reps):
    f(); ts=[]
    for _ in range(reps):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]
print(f"dtype {dtype}, threads {torch.get_num_threads()}")
print("shape rows exact_us int8_us exact/int8")
for name,n,k,kind in shapes:
    w=quantized(n,k,kind)
    ex=Linear(w, None, kernel=True, codes=True, dtype=dtype)
    if hasattr(ex, "serve_codes_up_to") and ex.panels is not None: ex.serve_codes_up_to(None)
    i8=Int8BlockCodeLinear(int8_block_codes(w), n)
    for m in rows:
        if name=="head" and m>64: continue
        x=torch.randn(m,k).to(dtype)
        reps=max(5,min(200,int(2e8/(n*k*m))))
        a=[];b=[]
        for _ in range(3):
            a.append(t(lambda: ex(x), reps)); b.append(t(lambda: i8(x), reps))
        te=sorted(a)[1]; ti=sorted(b)[1]
        print(f"{name} {m} {te*1e6:.1f} {ti*1e6:.1f} {te/ti:.2f}", flush=True)
