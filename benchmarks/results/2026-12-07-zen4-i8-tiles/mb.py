"""int8 products at many rows: us, G MAC/s, and bits against the scalar reference."""
import torch, time, sys
sys.path.insert(0,'tests/models')
from gguf_weights import quantized
from models import cpu_kernels as ck
from models.projections import int8_block_codes, Int8BlockCodeLinear
assert ck.load()
shapes=[("qkv",960,576,"q4_1"),("o",576,576,"q4_1"),("gate_up",3072,576,"q4_1"),("down",576,1536,"q4_1"),("head",49152,576,"q8_0")]
rows=[int(r) for r in sys.argv[1].split(",")] if len(sys.argv)>1 else [8,16,64,512]
dtype=torch.bfloat16
def t(f, reps):
    f(); ts=[]
    for _ in range(reps):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]
for name,n,k,kind in shapes:
    w=quantized(n,k,kind); i8=Int8BlockCodeLinear(int8_block_codes(w), n)
    for m in rows:
        if name=="head" and m>64: continue
        x=torch.randn(m,k).to(dtype)
        ref=ck.i8_block_linear_reference(x,*i8.codes,n,None)
        same=torch.equal(i8(x).view(torch.int16), ref.view(torch.int16))
        reps=max(5,min(300,int(3e8/(n*k*m))))
        ti=sorted(t(lambda: i8(x), reps) for _ in range(3))[1]
        print(f"{name:8s} {m:4d} {ti*1e6:9.1f} us {n*k*m/ti/1e9:6.1f} GMAC/s {'same' if same else 'DIFFERENT'}", flush=True)
