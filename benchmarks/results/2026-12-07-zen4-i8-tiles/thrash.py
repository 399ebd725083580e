"""int8 products hot, and each after a 40 MB copy (the caches flushed, as attention's K/V reads do in a step)."""
import torch, time, sys
sys.path.insert(0,'tests/models')
from gguf_weights import quantized
from models import cpu_kernels as ck
from models.projections import int8_block_codes, Int8BlockCodeLinear
assert ck.load()
m=int(sys.argv[1]) if len(sys.argv)>1 else 64
a=torch.randn(10<<20); b=torch.empty_like(a)
for name,n,k in (("gate_up",3072,576),("qkv",960,576),("down",576,1536)):
    w=quantized(n,k,"q4_1"); lin=Int8BlockCodeLinear(int8_block_codes(w), n)
    x=torch.randn(m,k).to(torch.bfloat16)
    hot=[];cold=[]
    for rep in range(200):
        b.copy_(a)
        s=time.perf_counter(); lin(x); cold.append(time.perf_counter()-s)
        s=time.perf_counter(); lin(x); hot.append(time.perf_counter()-s)
    hot.sort(); cold.sort()
    h=hot[len(hot)//2]; c=cold[len(cold)//2]
    print(f"{name} {m} rows: hot {h*1e6:.0f} us ({n*k*m/h/1e9:.0f} GMAC/s), after a flush {c*1e6:.0f} us ({n*k*m/c/1e9:.0f}), ratio {c/h:.2f}")
