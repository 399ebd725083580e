import torch, time, sys
sys.path.insert(0,'tests/models')
from gguf_weights import quantized
from models import cpu_kernels as ck
from models.projections import fp32_block_codes
assert ck.load()
torch.manual_seed(0)
shapes=[("qkv",960,576,"q4_1"),("o",576,576,"q4_1"),("gate_up",3072,576,"q4_1"),("down",576,1536,"q4_1"),("head",49152,576,"q8_0")]
rows=[int(r) for r in sys.argv[1].split(",")] if len(sys.argv)>1 else [1,8,64,512]
def t(f, reps):
    f(); ts=[]
    for _ in range(reps):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]
print("shape rows exact_us i8_us ratio")
for name,n,k,kind in shapes:
    w=quantized(n,k,kind)
    ex=fp32_block_codes(w)
    pk=ck.pack_i8_codes(*ck.pack_block_codes(w))
    for m in rows:
        if name=="head" and m>64: continue
        x=torch.randn(m,k)
        reps=max(5,min(200,int(2e8/(n*k*m))))
        te=t(lambda: ck.block_linear(x,*ex,n), reps)
        ti=t(lambda: ck.i8_block_linear(x,*pk,n), reps)
        print(f"{name} {m} {te*1e6:.1f} {ti*1e6:.1f} {te/ti:.2f}")
