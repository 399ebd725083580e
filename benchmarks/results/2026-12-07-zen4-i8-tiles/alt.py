"""int8 products, two env settings alternated call by call (a temporary kernel toggle): ratio A/B time."""
import torch, time, sys, os
sys.path.insert(0,'tests/models')
from gguf_weights import quantized
from models import cpu_kernels as ck
from models.projections import int8_block_codes, Int8BlockCodeLinear
assert ck.load()
var, a_val, b_val = sys.argv[1].split(",")
rows=[int(r) for r in sys.argv[2].split(",")]
shapes=[("qkv",960,576,"q4_1"),("o",576,576,"q4_1"),("gate_up",3072,576,"q4_1"),("down",576,1536,"q4_1"),("head",49152,576,"q8_0")]
only=sys.argv[3].split(",") if len(sys.argv)>3 else None
for name,n,k,kind in shapes:
    if only and name not in only: continue
    w=quantized(n,k,kind); i8=Int8BlockCodeLinear(int8_block_codes(w), n)
    for m in rows:
        x=torch.randn(m,k).to(torch.bfloat16)
        ref=ck.i8_block_linear_reference(x,*i8.codes,n,None)
        reps=max(20,min(2000,int(3e9/(n*k*m))))
        ta=[];tb=[]
        for v,ts in ((a_val,ta),(b_val,tb)):
            os.environ[var]=v; assert torch.equal(i8(x).view(torch.int16), ref.view(torch.int16)), (name,m,v)
        for i in range(reps):
            for v,ts in ((a_val,ta),(b_val,tb)) if i%2==0 else ((b_val,tb),(a_val,ta)):
                os.environ[var]=v; s=time.perf_counter(); i8(x); ts.append(time.perf_counter()-s)
        ta.sort(); tb.sort(); ma=ta[len(ta)//2]; mb=tb[len(tb)//2]
        print(f"{name:8s} {m:4d} {var}={a_val}: {ma*1e6:8.1f} us {n*k*m/ma/1e9:6.1f} GMAC/s  {var}={b_val}: {mb*1e6:8.1f} us {n*k*m/mb/1e9:6.1f}  A/B time {ma/mb:.3f}", flush=True)
