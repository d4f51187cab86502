"""read_rows on the hw backend: unpipelined (step 0) against pipelined steps, 64 KiB (8 KiB rows,
cached destination) and 32 MiB (8 KiB rows at a 16 KiB stride, NT destination), cold in cache."""
import os, sys, time, mmap, json
import numpy as np
import tract_kernels as K
from tract_async.region import index as ix
def med(f, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns(); f(); ts.append(time.perf_counter_ns() - t0)
    return float(np.median(ts)) / 1e3
N = 512 << 20
path = f"{os.environ.get('REGION_DIR', '/dev/shm')}/tract-inv-{os.getpid()}"
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, N)
mm = mmap.mmap(fd, N); os.close(fd); os.unlink(path)
buf = np.frombuffer(mm, dtype=np.uint8); buf[:] = 1
m = K.make_mem(buf, "hw"); ms = K.with_skip_site(m, ix.S_IX_PAYLOAD_READ)
out = {}
for label, size, stride, nt, reps in (("64K", 64 << 10, 8192, False, 3000), ("32M", 32 << 20, 16384, True, 12)):
    rows = size // 8192
    span = rows * stride
    nplans = max(2, (N - span) // max(span, 1 << 20))
    nplans = min(nplans, 200)
    def plan_for(base):
        p = np.zeros((rows, 3), np.int64); p[:, 0] = base + np.arange(rows) * stride; p[:, 1] = np.arange(rows) * 8192; p[:, 2] = 8192; return p
    plans = [plan_for(i * span if size > (1 << 20) else i * (1 << 20)) for i in range(nplans)]
    dst = np.zeros(size, np.uint8); d = np.uint64(dst.ctypes.data)
    it = [0]
    def rd(mm_):
        def f():
            it[0] = (it[0] + 1) % nplans; K.read_rows(mm_, plans[it[0]], d, ix.S_IX_PAYLOAD_READ, nt)
        return f
    res = {}
    for rnd in range(2):
        for st in (0, 2048, 4096, 8192, 16384):
            K.set_read_step(st)
            res.setdefault(f"step{st}", []).append(round(med(rd(m), reps), 2))
        K.set_read_step(0)
        res.setdefault("noinval", []).append(round(med(rd(ms), reps), 2))
    out[label] = res
    print(label, "us:", res, flush=True)
print(json.dumps(out))
