"""An intruder: busy BURST_US of CPU every PERIOD_US (a server's other processes, roughly), until killed."""
import os, time
burst, period = int(os.environ.get("BURST_US", 600)) / 1e6, int(os.environ.get("PERIOD_US", 6000)) / 1e6
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < burst: pass
    time.sleep(period - burst)
