"""A/B of speculative decoding on the runner alone (BatchState + ModelRunner, SmolLM2): runner_ab.py [DTYPE] [BATCHES] [CONFIGS JSON];
env TEMP (temperature, seed 1), KINDS (lookup,random), REPS, T (threads). Prints tok/s of the decode phase and drafts held."""
import sys, time, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import numpy as np, torch
from models.loading import load_model
from models.runner import ModelRunner
from serving.managers.batching import BatchState, Limits
from serving.managers.messages import GenerateReq, SamplingParams
from serving.managers.radix_cache import RadixCache
from serving.managers.speculative import SpeculativeConfig
from benchmarks.bench_serving import lookup_prompts

dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else None
batches = [int(x) for x in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["1", "8"])]
configs = {"none": None, **{name: SpeculativeConfig("ngram", **kw) for name, kw in json.loads(sys.argv[3] if len(sys.argv) > 3 else '{"k4": {}}').items()}}
import os
if os.environ.get("T"): torch.set_num_threads(int(os.environ["T"]))
loaded = load_model(None)
tok = loaded.tokenizer
runner = ModelRunner(loaded, dtype=dtype)
def chat(q):
    return tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
OUT = 128
def workload(kind, n, seed):
    rng = np.random.default_rng(seed)
    if kind == "lookup":
        return [chat(p) for p in lookup_prompts(rng, n, 256, chat=True)]
    return [rng.integers(1000, 20000, size=128).tolist() for _ in range(n)]

def run(spec, ps):
    st = BatchState(runner.kv, RadixCache(runner.kv.free), runner.eos_token_ids, Limits(chunked_prefill_size=512), speculative=spec)
    for i, p in enumerate(ps):
        st.add(GenerateReq(f"r{i}", np.asarray(p, dtype=np.int32), SamplingParams(max_new_tokens=OUT, temperature=float(os.environ.get("TEMP", "0")), seed=1, ignore_eos=True)))
    # prefill first (not timed)
    out = {}
    t0 = None; steps = 0
    while not st.idle:
        b = st.schedule()
        if t0 is None and all(len(s.token_ids) - s.num_draft == 1 for s in b.seqs):
            t0 = time.perf_counter(); gen0 = sum(len(v) for v in out.values())
        for o in st.postprocess(b, runner.step(b.seqs)):
            out.setdefault(o.req.rid, []).extend(o.new_ids)
        steps += 1
    dt = time.perf_counter() - t0
    gen = sum(len(v) for v in out.values()) - gen0
    st.cache.reset()
    return gen / dt, st.draft_tokens, st.accepted_tokens, out

print("dtype", runner.dtype, "threads", torch.get_num_threads())
run(None, workload("random", 2, 99))  # warm
for kind in os.environ.get("KINDS", "lookup,random").split(","):
    for b in batches:
        ps = workload(kind, b, b)
        res = {}
        for rep in range(int(os.environ.get('REPS', '2'))):
            for name, spec in configs.items():
                tps, d, a, out = run(spec, ps)
                res.setdefault(name, []).append(tps)
                if rep == 0:
                    if name == "none": ref = out
                    same = out == ref
                    print(f"{kind} b{b} {name}: drafts {d} accepted {a} ({a/max(d,1):.0%}) same={same}", flush=True)
        print(kind, f"b{b}", {k: [round(x, 1) for x in v] for k, v in res.items()},
              {k: f"{np.mean(v)/np.mean(res['none']):.3f}" for k, v in res.items()}, flush=True)
