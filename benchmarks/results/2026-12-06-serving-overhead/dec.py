import time, os, threading
from models.loading import load_model
tok = load_model(None).tokenizer
b = tok.backend_tokenizer
seqs = [[1000, 2000, 3000, 4000, 5000], [3000, 4000, 5000, 6000]]
def t(fn, n=2000):
    t0 = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t0) / n * 1e6
c0 = time.process_time()
print("decode_batch us", t(lambda: b.decode_batch(seqs, skip_special_tokens=True)), "cpu/wall", )
print("decode x2 us", t(lambda: [b.decode(s, skip_special_tokens=True) for s in seqs]))
print("threads", threading.active_count(), len(os.listdir('/proc/self/task')))
