"""64 sequences of 128 prompt tokens prefilled, then decode steps of all 64 (a served c64 wave's decode), exact and
int8; torch.profiler's table of 16 decode steps each."""
import sys, time, torch
from models.loading import load_model
from models.runner import ModelRunner, default_dtype, SeqInput
B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
loaded = load_model(None)
dtype = default_dtype(torch.device("cpu"))
for name, kw in (("int8", {"int8_activations": True}),):
    r = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 30, **kw)
    prompts = [list(range(100 + 150 * i, 228 + 150 * i)) for i in range(B)]
    pages = [r.kv.allocate(r.kv.pages_for(128 + 40)) for _ in prompts]
    seqs = [list(p) for p in prompts]
    for i in range(0, B, 8):
        out = r.step([SeqInput(seqs[j], pages[j]) for j in range(i, i + 8)])
        for j, t in zip(range(i, i + 8), out.token_ids):
            seqs[j].append(t)
    def decode():
        out = r.step([SeqInput(s[-1:], pg, num_cached=len(s) - 1) for s, pg in zip(seqs, pages)])
        for s, t in zip(seqs, out.token_ids): s.append(t)
    for _ in range(3): decode()
    t = time.perf_counter()
    for _ in range(8): decode()
    dt = (time.perf_counter() - t) / 8
    print(name, f"decode step of {B}: {dt*1e3:.1f} ms, {B/dt:.0f} tok/s", flush=True)
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(8): decode()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=30, max_shapes_column_width=90))
