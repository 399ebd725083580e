import time, torch, random
from models import cpu_kernels
from models.runner import nan_rows
from models.sampling import sample, SamplingParams
cpu_kernels.load()
for B in (1, 64):
    logits = torch.randn(B, 49152)
    params = [SamplingParams(temperature=0.0)] * B  # greedy
    pos, pr, out = [10] * B, [[1]] * B, [[]] * B
    def old():
        nan_rows(logits); return sample(logits, params, pos, pr, out)
    def new():
        red = cpu_kernels.argmax_logsumexp(logits); nan_rows(logits, torch.isnan(red[1])); return sample(logits, params, pos, pr, out, reduced=red)
    assert old().token_ids == new().token_ids and old().logprobs == new().logprobs
    t = {"old": [], "new": []}
    for _ in range(200):
        for name, f in random.sample([("old", old), ("new", new)], 2):
            t0 = time.perf_counter(); f(); t[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in t.items()}
    print(f"B={B}: old {med['old']:.3f} ms, new {med['new']:.3f} ms, saved {med['old'] - med['new']:.3f} ms")
