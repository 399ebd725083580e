import torch, resource
from models.loading import load_model
from models.runner import ModelRunner
r = ModelRunner(load_model(None), dtype=torch.bfloat16, kv_budget_bytes=1 << 26)
import gc; gc.collect()
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
print(f"rss after load {rss / 2**20:.0f} MiB (max {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
