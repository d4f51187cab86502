"""The Python around a layer stream's CUDA calls, on the CPU: put_layer / get_layer with a copier
stand-in whose enqueue records nothing and whose event has always completed. Throwaway profile
harness (not a test): what the streams cost besides cudart."""
import asyncio, cProfile, os, pstats, statistics, sys, tempfile, time
import numpy as np, torch
sys.path.insert(0, "/work/main/bench")
import _common as C
import tract_async as tract
from tract_async.stores.txn import PutTxn, ReadTxn
from tract_async.cuda import store as cs, layerstream as ls, direct
from tract_async.cuda.store import CudaPath
from tract_async.region.index import SNAP_POFF

class Ev:
    def query(self): return True
    def synchronize(self): pass

class FakeCopier:
    def put_direct(self, dc, t, ready): return Ev(), (t,)
    def get_direct(self, dc, t, after): return Ev(), (t,)

class P:                     # the CudaPath parts the steps use
    def __init__(self):
        self.streams = ls.Streams(); self.futures_created = 0; self._outstanding = set()
        self.validation_failures = 0
    track = CudaPath.track

class _R:
    def __init__(self): self.a = 1; self.b = [0]
    def f(self, x): return self.a + x
def _ref():
    """a fixed Python workload: the CPU-speed yardstick of this process"""
    r = _R(); t = 0
    for i in range(60):
        t += r.f(i); r.b.append(i); d = {"k": i}; t += d["k"]
    return t
REF = []
def ref_time():
    c0 = time.perf_counter_ns(); _ref(); REF.append(time.perf_counter_ns() - c0)

async def main(n, prof):
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s51p-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(2 << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="s50", mode=os.environ.get("MODE", "cache"))
    async with tract.Engine.open(cfg) as eng:
        store = eng._store; b = store.blocks; cp = P()
        from tract_async.region import cpumarks, index as ix
        sw = cpumarks.Sweeper(b.cpu_marks, b.mem, ix.S_IX_PAYLOAD_READ); sw.done.wait(60)
        kv = torch.zeros(lay.kv_shape(n, 0), dtype=lay.dtype)
        times = {"put": [], "get": []}
        pr = cProfile.Profile()
        for r in range(60):
            keys = eng.block_keys(range(r * 100000, r * 100000 + 16 * n))
            txn = PutTxn(b, keys, 0, None, "cuda"); await txn.begin()
            poffs = txn.offsets()
            tmpl = direct.template(lay, poffs, False, 0)
            s = ls.PutStream(keys, kv, FakeCopier(), tmpl, lay.num_layers, txn.res)
            txn.publish(n * lay.layer_bytes)
            if r >= 10 and prof: pr.enable()
            for L in range(1, lay.num_layers):
                c0 = time.thread_time_ns(); t0 = time.perf_counter_ns()
                fut = await cs.put_layer(store, cp, s, L, kv, None, None)
                await fut
                t2 = time.perf_counter_ns(); c2 = time.thread_time_ns()
                if r >= 10: times["put"].append((t2 - t0, c2 - c0)); ref_time()
            if prof: pr.disable()
            rt = ReadTxn(b, keys, 0, None, "cuda"); snap = (await rt.prepare()).copy()
            gs = ls.GetStream(keys, kv, FakeCopier(), tmpl, lay.num_layers,
                              np.ascontiguousarray(snap[:, SNAP_POFF]), snap, rt.words)
            if r >= 10 and prof: pr.enable()
            for L in range(1, lay.num_layers):
                c0 = time.thread_time_ns(); t0 = time.perf_counter_ns()
                fut = await cs.get_layer(store, cp, gs, L, kv, None, None, kv)
                await fut
                t2 = time.perf_counter_ns(); c2 = time.thread_time_ns()
                if r >= 10: times["get"].append((t2 - t0, c2 - c0)); ref_time()
            if prof: pr.disable()
            await eng.evict(keys) if hasattr(eng, "evict") else None
        for op, v in times.items():
            print(f"{n} blocks {op}: wall {statistics.median([a for a, _ in v])/1e3:.1f} us, "
                  f"thread cpu {statistics.median([c for _, c in v])/1e3:.1f} us")
        rm = statistics.median(REF)
        print(f"ref {rm/1e3:.2f} us; put/ref {statistics.median([a for a, _ in times['put']])/rm:.3f} get/ref {statistics.median([a for a, _ in times['get']])/rm:.3f}")
        if prof:
            pstats.Stats(pr).sort_stats("tottime").print_stats(35)
if __name__ == "__main__" and not os.environ.get("STEPS"): asyncio.run(main(int(sys.argv[1]), len(sys.argv) > 2))

import numba
import tract_kernels as K
@numba.njit(cache=False)
def _held_fresh(m, off, site):
    return K.load_fresh(m, off, site)

async def steps(n):
    """put_layer's and get_layer's steps timed one by one (same order, same calls)."""
    from tract_async.cuda.store import _put_future, _validator, invalidate_for_dma, LINK_BYTES_PER_S
    from tract_async.cuda.futures import StreamFuture
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s51q-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(2 << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="s50", mode=os.environ.get("MODE", "cache"))
    async with tract.Engine.open(cfg) as eng:
        store = eng._store; b = store.blocks; cp = P()
        from tract_async.region import cpumarks, index as ix
        sw = cpumarks.Sweeper(b.cpu_marks, b.mem, ix.S_IX_PAYLOAD_READ); sw.done.wait(60)
        kv = torch.zeros(lay.kv_shape(n, 0), dtype=lay.dtype)
        pc = time.perf_counter_ns
        acc = {}
        def add(k, v): acc.setdefault(k, []).append(v)
        fc = FakeCopier()
        for r in range(60):
            keys = eng.block_keys(range(r * 100000, r * 100000 + 16 * n))
            txn = PutTxn(b, keys, 0, None, "cuda"); await txn.begin()
            poffs = txn.offsets()
            tmpl = direct.template(lay, poffs, False, 0)
            s = ls.PutStream(keys, kv, fc, tmpl, lay.num_layers, txn.res)
            txn.publish(n * lay.layer_bytes)
            for L in range(1, lay.num_layers):
                t = [pc()]
                s.fits(L, kv); t.append(pc())
                tx = PutTxn(b, s.keys, L, None, "cuda"); tx.resume(); t.append(pc())
                if False:
                    _held_fresh(b.alloc._region.mem, b.alloc.geo.count_off(b.alloc.node_id) + 8, 0)
                else:
                    b.alloc.check_not_fenced()
                t.append(pc())
                dc = s.tmpl.at(L, kv.data_ptr()); t.append(pc())
                ev, keep = fc.put_direct(dc, kv, None); t.append(pc())
                fut = _put_future(tx, ev, keep, s.nbytes, "put/direct", True, b.spin_ns); t.append(pc())
                cp.track(fut); t.append(pc())
                await fut; t.append(pc())
                if r >= 10:
                    for k, name in enumerate(("fits", "txn+resume", "fence check", "tmpl.at", "copier(fake)", "future", "track", "await(publish)")):
                        add("put " + name, t[k + 1] - t[k])
            rt = ReadTxn(b, keys, 0, None, "cuda"); snap = (await rt.prepare()).copy()
            gs = ls.GetStream(keys, kv, fc, tmpl, lay.num_layers,
                              np.ascontiguousarray(snap[:, SNAP_POFF]), snap, rt.words)
            for L in range(1, lay.num_layers):
                t = [pc()]
                gs.fits(L, kv); t.append(pc())
                tx = ReadTxn(b, gs.keys, L, None, "cuda", words=gs.words); t.append(pc())
                assert tx.prepare_known(gs.rows); t.append(pc())
                await invalidate_for_dma(b, gs.poffs, L); t.append(pc())
                dc = gs.tmpl.at(L, kv.data_ptr()); t.append(pc())
                ev, keep = fc.get_direct(dc, kv, None); t.append(pc())
                v = _validator(cp, tx, gs.nbytes, kv, cpu=False, on_miss=lambda: None)
                fut = StreamFuture(ev, completion=v, keep=keep, nbytes=gs.nbytes,
                                   not_before_s=gs.nbytes / LINK_BYTES_PER_S, label="get/direct", spin_ns=b.spin_ns)
                t.append(pc())
                cp.track(fut); t.append(pc())
                await fut; t.append(pc())
                if r >= 10:
                    for k, name in enumerate(("fits", "txn", "prepare_known", "invalidate check", "tmpl.at", "copier(fake)", "validator+future", "track", "await(validate)")):
                        add("get " + name, t[k + 1] - t[k])
        for k, v in acc.items():
            print(f"{k:28s} {statistics.median(v)/1e3:6.2f} us")

if __name__ == "__main__" and os.environ.get("STEPS"):
    asyncio.run(steps(int(sys.argv[1])))
