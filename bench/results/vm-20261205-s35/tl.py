"""Timeline of a layer-streamed handoff between two processes: per layer, the producer's put
start/end and the consumer's get start/end (one CLOCK_MONOTONIC), µs from the producer's first
put. argv: MiB reps [copy_threads]."""
import asyncio, os, sys, time, statistics as S
import multiprocessing as mp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch
import tract_async as tract
from _putget.fixtures import LAYOUT, BLOCK, det_keys, engine_cfg, make_kv, MiB, REGION_OVERHEAD
from _putget.handoff import arecv
L = LAYOUT.num_layers

PROF = {}
def _wrapc():
    import collections
    from tract_async.stores import blocks as B, cpucopy as CC
    from tract_async.region import index as ix
    from tract_async import keys as KK
    T = collections.defaultdict(list)
    def w(obj, name, is_async=False):
        f = getattr(obj, name)
        if is_async:
            async def g(*a, **k):
                t = time.perf_counter_ns(); r = await f(*a, **k); T[name].append(time.perf_counter_ns()-t); return r
        else:
            def g(*a, **k):
                t = time.perf_counter_ns(); r = f(*a, **k); T[name].append(time.perf_counter_ns()-t); return r
        setattr(obj, name, g)
    w(ix.PrefixIndex, "snapshot")
    try:
        from tract_async.stores import parallel as PP
        w(PP.ParallelReads, "get", True)
    except ImportError:
        pass
    w(B.BlockLifecycle, "_wait_ready", True); w(B.BlockLifecycle, "prepare_read", True)
    w(B.BlockLifecycle, "validate_read"); w(CC.CpuCopier, "copy_out", True); w(B.BlockLifecycle, "consume", True)
    return T

async def consume(path, rb, nb, reps, conn):
    n = nb // BLOCK
    T = _wrapc() if os.environ.get("TLPROF") else None
    async with tract.Engine.open(engine_cfg(path, 0, rb, True)) as eng:
        if hasattr(eng._store, "parallel"):
            eng._store.parallel.enabled = os.environ.get("TLPAR", "1") == "1"
        conn.send("ready")
        out = torch.empty(LAYOUT.kv_shape(n), dtype=LAYOUT.dtype)
        rows = []
        for i in range(reps):
            keys = det_keys("t", i, n)
            await arecv(conn)
            st = []
            async def ga():
                for l in range(L):
                    a = time.perf_counter_ns()
                    await eng.get_kv(keys, layer=l, out=out[l], timeout=30.0)
                    st.append((a, time.perf_counter_ns()))
            task = asyncio.create_task(ga()); await asyncio.sleep(0)
            conn.send("waiting"); await task
            rows.append(st); conn.send("done")
        await arecv(conn)
        if T is not None:
            rows.append({k: (len(v) / reps / L, S.median(v[len(v)//4:]) / 1e3) for k, v in T.items()})
        return rows

async def produce(path, rb, nb, reps, conn):
    n = nb // BLOCK
    eng = await tract.Engine.open(engine_cfg(path, 1, rb, False))
    kv = make_kv(n); rows = []
    try:
        for i in range(reps):
            keys = det_keys("t", i, n)
            conn.send("go"); await arecv(conn); await asyncio.sleep(0.001)
            st = []
            for l in range(L):
                a = time.perf_counter_ns(); await eng.put_kv(keys, kv[l], layer=l); st.append((a, time.perf_counter_ns()))
            rows.append(st); await arecv(conn)
    finally:
        await eng.close(); conn.send("closed")
    return rows

def runc(*a): a[-1].send(tract.run(consume(*a[:-2], a[-2])))
def runp(*a): a[-1].send(tract.run(produce(*a[:-2], a[-2])))

def main():
    nb = int(sys.argv[1]) * MiB; reps = int(sys.argv[2])
    if len(sys.argv) > 3: os.environ["TRACT_BENCH_COPY_THREADS"] = sys.argv[3]
    rb = (reps + 2) * nb + REGION_OVERHEAD
    path = f"/dev/shm/tract-tl-{os.getpid()}"
    ctx = mp.get_context("spawn"); a, b = ctx.Pipe(); rc, rc2 = ctx.Pipe(); rp, rp2 = ctx.Pipe()
    c = ctx.Process(target=runc, args=(path, rb, nb, reps, a, rc2), daemon=True); c.start()
    b.poll(120); b.recv()
    p = ctx.Process(target=runp, args=(path, rb, nb, reps, b, rp2), daemon=True); p.start()
    try:
        prow = rp.recv(); crow = rc.recv()
    finally:
        p.join(20); c.join(20)
        if os.path.exists(path): os.unlink(path)
    if isinstance(crow[-1], dict):
        print("consumer per layer get: " + "  ".join(f"{k} {c:.1f}x {m:.0f}us" for k, (c, m) in crow[-1].items()))
        crow = crow[:-1]
    tot = []
    for i, (pr, cr) in enumerate(zip(prow, crow)):
        t0 = pr[0][0]
        tot.append((cr[-1][1] - t0) / 1e3)
        if i >= reps - 3:
            print(f"rep {i}: " + " | ".join(f"L{l} put {(pa-t0)/1e3:.0f}-{(pb-t0)/1e3:.0f} get {(ga-t0)/1e3:.0f}-{(gb-t0)/1e3:.0f}" for l, ((pa, pb), (ga, gb)) in enumerate(zip(pr, cr))))
    print(f"{nb>>20} MiB layers copy_threads={sys.argv[3] if len(sys.argv)>3 else 'auto'}: handoff p50 {S.median(tot[1:]):.0f} us  min {min(tot[1:]):.0f}  ({nb/S.median(tot[1:])/1e3:.2f} GB/s)")
if __name__ == "__main__":
    main()
