"""SmolLM2 at batch 1 in a given dtype (the runner alone): 16 tokens after a 48-token prompt, after 2 to warm up.
Usage (from a tree's root): python half_decode.py float16 JSON_PATH"""
import json
import sys
import time

import torch

from models.loading import load_model
from models.runner import ModelRunner, generate

dtype = sys.argv[1]
runner = ModelRunner(load_model(), dtype=getattr(torch, dtype))
prompt = list(range(100, 148))
generate(runner, [prompt], 2)
start = time.perf_counter()
out = generate(runner, [prompt], 16)[0]
seconds = time.perf_counter() - start
result = {"dtype": dtype, "projections": type(runner.model.lm_head).__name__,
          "invariant_paths": runner.model.invariant_paths, "tokens": 16, "seconds": seconds,
          "tok_s": 16 / seconds, "output_ids": out}
print(json.dumps({k: v for k, v in result.items() if k != "output_ids"}))
with open(sys.argv[2], "w") as f:
    json.dump(result, f, indent=1)
