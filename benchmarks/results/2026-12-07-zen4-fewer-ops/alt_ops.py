"""The decode batch's tables in Python and the logits' rows as they are, on and off step by step in one process
(off: the previous commit's _decode_tables and an index of the rows)."""
import os, sys, time, statistics, builtins, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
import models.batch as mb, models.runner as mr
from models.kv_cache import pages_for
def old_tables(decode, page_size):
    if not decode:
        empty = torch.zeros(0, dtype=torch.int32)
        return empty.view(0, 1), empty, empty.long()
    widths = [pages_for(s.num_cached + 1, page_size) for s in decode]
    widest = max(widths)
    table = torch.tensor([[*s.page_table[:w], *([0] * (widest - w))] for s, w in zip(decode, widths)], dtype=torch.int32)
    last = torch.tensor([s.num_cached for s in decode])
    slots = table.long()[torch.arange(len(decode)), last // page_size] * page_size + last % page_size
    return table, (last + 1).to(torch.int32), slots
new_tables = mb._decode_tables
B, P, N = (int(a) for a in sys.argv[1:4])
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30, int8_activations=bool(os.environ.get("INT8")))
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
last = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
times = {"new": [], "old": []}; toks = {"new": [], "old": []}
for n in range(20, 20 + N):
    on = n % 2 == 0
    mb._decode_tables = new_tables if on else old_tables
    mr.list = builtins.list if on else (lambda x: [-1])
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); out = runner.step(batch); times["new" if on else "old"].append(time.perf_counter() - t0)
    last = out.token_ids
a, b = statistics.median(times["new"]), statistics.median(times["old"])
print(f"B={B} P={P} {'int8' if os.environ.get('INT8') else 'exact'} new {1e3*a:.3f} ms, old {1e3*b:.3f} ms: {b/a:.3f}x (mean {statistics.mean(times['old'])/statistics.mean(times['new']):.3f}x)")
