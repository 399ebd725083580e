import torch, time
x = torch.ones(64 << 20, dtype=torch.float32)
for _ in range(3): x.sum()
ts=[]
for _ in range(10):
    t=time.perf_counter(); x.sum(); ts.append(time.perf_counter()-t)
print(f"read {x.numel()*4/min(ts)/1e9:.1f} GB/s best, {x.numel()*4/sorted(ts)[5]/1e9:.1f} median")
