import sys, time, json
sys.path.insert(0, sys.argv[1])
import torch
from models.loading import load_model
from models.runner import ModelRunner, generate
r = ModelRunner(load_model(None))
prompt = [[1,2,3,4,5,6,7,8]*4]
generate(r, prompt, 16)
out = []
for _ in range(3):
    t = time.perf_counter(); generate(r, prompt, 128); out.append(128 / (time.perf_counter() - t))
print(sys.argv[1], "b1 tok/s", [round(v, 1) for v in out])
