"""Where a large put/get's time goes, function by function (one process). argv: MiB reps."""
import asyncio, os, sys, time, collections, statistics as S
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch, numpy as np
import tract_async as tract
from tract_async.stores import blocks as B, region as R, cpucopy as CC, plan as PL
from tract_async.region import alloc as A, index as ix
from tract_async import keys as KEYS
from _putget.fixtures import LAYOUT, BLOCK, det_keys, engine_cfg, make_kv, MiB, REGION_OVERHEAD
T = collections.defaultdict(list)
CUR = [""]
def wrap(obj, name, is_async=False):
    f = getattr(obj, name)
    if is_async:
        async def g(*a, **k):
            t = time.perf_counter_ns(); r = await f(*a, **k); T[(CUR[0], name)].append(time.perf_counter_ns()-t); return r
    else:
        def g(*a, **k):
            t = time.perf_counter_ns(); r = f(*a, **k); T[(CUR[0], name)].append(time.perf_counter_ns()-t); return r
    setattr(obj, name, g)
for n in ("snapshot", "filling", "reservations", "publish", "_place",
          "_alloc_many_locked", "_reserve_lockfree", "validate_read", "_take_spares"):
    wrap(B.BlockLifecycle, n)
for n in ("reserve", "_reserve", "_reserve_locked", "prepare_read", "consume", "hold_lock"):
    wrap(B.BlockLifecycle, n, True)
wrap(A.Allocator, "alloc_many_nowait"); wrap(A.Allocator, "alloc_many_locked")
wrap(CC.CpuCopier, "copy_in", True); wrap(CC.CpuCopier, "copy_out", True)
wrap(PL, "plan"); wrap(ix, "reserve_batch_counted"); wrap(B, "allocation_rows") if False else None
from tract_async.region import alloc as AL
wrap(AL.Allocator, "_publish"); wrap(AL._Chunk, "set_used")
R.keys_to_words = (lambda f: (lambda *a: (lambda t: (f(*a), T[(CUR[0], "keys_to_words")].append(time.perf_counter_ns()-t))[0])(time.perf_counter_ns())))(R.keys_to_words)
async def main():
    nb = int(sys.argv[1]) * MiB; reps = int(sys.argv[2]); n = nb // BLOCK
    path = f"/dev/shm/tract-rprof-{os.getpid()}"
    async with tract.Engine.open(engine_cfg(path, 0, (2 * reps + 3) * nb + REGION_OVERHEAD, True)) as eng:
        kv = make_kv(n); out = torch.empty_like(kv)
        for i in range(reps):
            kb = det_keys("b", i, n); kl = det_keys("l", i, n)
            rec = i >= 2
            await asyncio.sleep(0.003)
            CUR[0] = "put_block" if rec else "warm"
            t = time.perf_counter_ns(); await eng.put_kv(kb, kv); T[(CUR[0], "TOTAL")].append(time.perf_counter_ns() - t)
            await asyncio.sleep(0.003)
            for l in range(LAYOUT.num_layers):
                CUR[0] = (f"put_l{min(l,1)}" if rec else "warm")
                t = time.perf_counter_ns(); await eng.put_kv(kl, kv[l], layer=l); T[(CUR[0], "TOTAL")].append(time.perf_counter_ns() - t)
            await asyncio.sleep(0.003)
            CUR[0] = "get_block" if rec else "warm"
            t = time.perf_counter_ns(); await eng.get_kv(kb, out=out); T[(CUR[0], "TOTAL")].append(time.perf_counter_ns() - t)
            for l in range(LAYOUT.num_layers):
                CUR[0] = "get_layer" if rec else "warm"
                t = time.perf_counter_ns(); await eng.get_kv(kl, layer=l, out=out[l]); T[(CUR[0], "TOTAL")].append(time.perf_counter_ns() - t)
        st = eng.stats()
        print(f"{nb>>20} MiB n={n} copy_threads={eng._store.copy_threads if hasattr(eng,'_store') else '?'} lockfree={st.get('lockfree_reservations')} locks={st.get('lock_acquisitions')}")
    for op in ("put_block", "put_l0", "put_l1", "get_block", "get_layer"):
        items = sorted(((k[1], v) for k, v in T.items() if k[0] == op), key=lambda kv: -S.median(kv[1]) * len(kv[1]))
        print(op + ": " + "  ".join(f"{name} {S.median(v)/1e3:.0f}x{len(v)//max(1,len(T[(op,'TOTAL')]))}" for name, v in items))
    if os.path.exists(path): os.unlink(path)
asyncio.run(main())
