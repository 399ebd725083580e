import gc, os, time, sys
_t = {}
_f = None
_counts = [0, 0, 0]
def _cb(phase, info):
    global _f
    if phase == "start":
        _t["s"] = time.perf_counter(); return
    g = info["generation"]; _counts[g] += 1
    d = time.perf_counter() - _t.get("s", time.perf_counter())
    if d > 0.002 or g == 2:
        if _f is None: _f = open(f"/tmp/p39/gclog/{os.getpid()}.txt", "a", buffering=1)
        _f.write(f"{time.time():.3f} gen{g} {d*1e3:.2f} ms collected={info['collected']} counts={_counts} argv={' '.join(sys.argv[:3])[:80]}\n")
gc.callbacks.append(_cb)
