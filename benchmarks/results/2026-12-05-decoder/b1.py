"""Batch-1 greedy decode of the embedded SmolLM2 in the runner (bf16 as served, deterministic), from the
checkout given: tok/s of 3 runs of 128 tokens after a warm-up, as one JSON line.

    python b1.py CHECKOUT LABEL
"""

import json
import sys
import time

sys.path.insert(0, sys.argv[1])

from models.loading import load_model  # noqa: E402
from models.runner import ModelRunner, generate  # noqa: E402

runner = ModelRunner(load_model(None))
prompt = [[1, 2, 3, 4, 5, 6, 7, 8] * 4]
generate(runner, prompt, 16)
runs = []
for _ in range(3):
    start = time.perf_counter()
    generate(runner, prompt, 128)
    runs.append(round(128 / (time.perf_counter() - start), 1))
print(json.dumps({"label": sys.argv[2], "decoder": runner.model.__dict__.get("decoder") is not None,
                  "dtype": str(runner.dtype), "tok_s": runs}))
