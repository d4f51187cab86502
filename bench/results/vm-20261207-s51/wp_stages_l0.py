"""A whole-prompt put's start on the CPU, its stages timed by wrappers (no profiler): medians of
10 rounds. Throwaway."""
import asyncio, os, sys, statistics, time, functools, collections
N = int(os.environ.get("N", "213"))
import wp_start_l0 as W
from tract_async.stores import reservation as RS, txn as TX, chunkgive as CG
from tract_async.region import alloc as AL, index as IX
from tract_async.cuda import store as CS, direct as DR
T = collections.defaultdict(list)
if os.environ.get("GIVE_S"):
    from tract_async.stores import chunkgive as _CGM
    _CGM.GIVE_CHECK_S = float(os.environ["GIVE_S"])
if os.environ.get("HELD") == "1":
    import numba, tract_kernels as K
    _rb = K.read_bytes
    @numba.njit(cache=False)
    def _held_read(m, off, dst, n, site):
        return _rb(m, off, dst, n, site)
    from tract_async.region import chunks as CH
    class _KP:
        def __getattr__(self, a): return getattr(K, a)
    kp = _KP(); kp.read_bytes = _held_read
    CH.K = kp
def wrap(owner, name, label):
    f = getattr(owner, name)
    if asyncio.iscoroutinefunction(f):
        @functools.wraps(f)
        async def g(*a, **k):
            t0 = time.perf_counter_ns()
            try: return await f(*a, **k)
            finally: T[label].append(time.perf_counter_ns() - t0)
    else:
        @functools.wraps(f)
        def g(*a, **k):
            t0 = time.perf_counter_ns()
            try: return f(*a, **k)
            finally: T[label].append(time.perf_counter_ns() - t0)
    setattr(owner, name, g)
wrap(CS, "_start_put", "start_put total")
wrap(TX.PutTxn, "begin", " txn.begin")
wrap(TX.PutTxn, "key_words", "  key_words")
wrap(RS.Reservations if hasattr(RS, "Reservations") else RS.Reserver, "snapshot_for_put", "  snapshot_for_put")
cls = RS.Reservations if hasattr(RS, "Reservations") else RS.Reserver
wrap(cls, "reserve", "  reserve")
wrap(RS.ChunkGiver, "check_passes", "   check_passes")
wrap(AL.Allocator, "alloc_many_nowait", "   alloc_many_nowait")
wrap(AL.Allocator, "check_not_fenced", "   check_not_fenced")
wrap(cls, "place", "   place")
from tract_async.region import chunks as CH2
wrap(CH2.ChunkTable if hasattr(CH2, "ChunkTable") else [v for v in vars(CH2).values() if isinstance(v, type) and "wanted" in vars(v)][0], "wanted", "    table.wanted")
wrap(AL.Allocator, "owned_chunks", "    owned_chunks")
wrap(AL.Allocator, "drain_returns", "    drain_returns")
wrap(AL.Allocator, "_publish", "    alloc._publish")

import tract_async.cuda.layerstream as LSM
wrap(LSM.Streams, "add_put", " streams.add_put")
wrap(LSM.PutStream, "__init__", " PutStream()")
wrap(RS.ChunkGiver, "others_ask", "    others_ask")
wrap(RS.ChunkGiver, "due", "    due")
wrap(cls, "_reserve_lockfree", "   _reserve_lockfree")
wrap(cls, "_reserve", "   _reserve")
from tract_async.stores import preclaim as PCL, fillbook as FB
for nm in ("put_started", "note_put"):
    for c in vars(PCL).values():
        if isinstance(c, type) and nm in vars(c): wrap(c, nm, "    preclaim." + nm)
wrap(FB.FillBook, "reservations", "  book.reservations")
wrap(FB.FillBook, "filling", "  book.filling")
wrap(IX, "reserve_batch_counted", "    reserve_batch_counted")
wrap(W.FakeCopier, "direct_template", " direct_template")
wrap(DR.Template, "at", " template.at")
wrap(CS, "_put_future", " _put_future")

asyncio.run(W.main(N, False))
for k, v in T.items():
    v = v[2:] if len(v) > 4 else v
    print(f"{k:32s} {statistics.median(v)/1e3:8.1f} us  (n={len(v)})")
