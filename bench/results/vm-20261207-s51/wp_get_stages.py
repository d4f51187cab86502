"""A whole-prompt CUDA get's start on the CPU (stand-in copier), its stages timed by wrappers
(no profiler): medians of 10 rounds. Throwaway."""
import asyncio, os, sys, statistics, time, functools, collections
import wp_start as W
from tract_async.stores import txn as TX, reading as RD, blocks as BL
from tract_async.region import cpumarks as CM, index as IX
from tract_async.cuda import store as CS, direct as DR, futures as FU
T = collections.defaultdict(list)
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
wrap(CS, "_start_get", "start_get total")
wrap(TX.ReadTxn, "prepare", " txn.prepare")
for c in vars(RD).values():
    if isinstance(c, type) and "prepare_read" in vars(c): wrap(c, "prepare_read", "  reader.prepare_read")
for nm in ("read_words", "snapshot", "lookup_batch"):
    if hasattr(BL.BlockLifecycle, nm): wrap(BL.BlockLifecycle, nm, "   blocks." + nm)
wrap(IX, "lookup_batch", "   ix.lookup_batch") if hasattr(IX, "lookup_batch") else None
wrap(CS, "invalidate_for_dma", " invalidate_for_dma")
wrap(CM.CpuMarks, "needing", "  marks.needing")
wrap(W.FakeCopier, "direct_template", " direct_template")
wrap(DR.Template, "at", " template.at")
wrap(W.FakeCopier, "get_direct", " get_direct(fake)")
wrap(FU.StreamFuture, "__init__", " StreamFuture()")
wrap(CS, "_validator", " _validator")
wrap(FU.Poller, "add", "  poller.add")
from tract_async.cuda import layerstream as LS
wrap(LS.Streams, "add_get", " streams.add_get")
wrap(LS.GetStream, "__init__", " GetStream()")
asyncio.run(W.main(213, False))
for k, v in sorted(T.items()):
    v = v[2:] if len(v) > 4 else v
    print(f"{k:32s} {statistics.median(v)/1e3:8.1f} us  (n={len(v)})")
