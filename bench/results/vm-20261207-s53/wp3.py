"""VM: pieces of PutTxn.begin in the whole-prompt reps (transfer mode, consume in between)."""
import asyncio, sys, time, tempfile, statistics, functools, collections
sys.path.insert(0, "/work/main/bench")
import _common as C
import torch
import tract_async as tract
from tract_async.stores import txn as T, reservation as R, blocks as B
from tract_async.region import alloc as A

ACC = collections.defaultdict(list)
def wrap(cls, name, label, is_async=False):
    f = getattr(cls, name)
    if is_async:
        async def g(*a, **k):
            t0 = time.perf_counter_ns(); r = await f(*a, **k); ACC[label].append((time.perf_counter_ns()-t0)/1e3); return r
    else:
        def g(*a, **k):
            t0 = time.perf_counter_ns(); r = f(*a, **k); ACC[label].append((time.perf_counter_ns()-t0)/1e3); return r
    setattr(cls, name, g)

wrap(T.PutTxn, "begin", "begin", True)
wrap(R.Reserver, "snapshot_for_put", "snapshot_for_put")
wrap(R.Reserver, "place", "place")
wrap(A.Allocator, "alloc_many_nowait", "alloc_many_nowait")
wrap(R.Reserver, "_reserve_lockfree", "_reserve_lockfree")
wrap(R.Reserver, "_reserve_locked", "_reserve_locked", True)
from tract_async.stores import chunkgive as CG
wrap(CG.ChunkGiver if hasattr(CG, "ChunkGiver") else CG.__dict__[[k for k in CG.__dict__ if isinstance(CG.__dict__[k], type) and hasattr(CG.__dict__[k], "check_passes")][0]], "check_passes", "check_passes")
wrap(A.Allocator, "check_not_fenced", "check_not_fenced")
wrap(A.Allocator, "_take_rows", "_take_rows")
wrap(A.Allocator, "drain_returns", "drain_returns")
from tract_async.region import index as IX
wrap(IX.PrefixIndex, "reserve_batch", "ix.reserve_batch") if hasattr(IX.PrefixIndex, "reserve_batch") else None

async def main(n=213, reps=10):
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-wp3-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=n * lay.block_bytes + (1 << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="wp3", mode="transfer")
    async with tract.Engine.open(cfg) as eng:
        kv = torch.zeros(lay.kv_shape(n), dtype=lay.dtype)
        out = torch.empty_like(kv)
        for r in range(reps + 1):
            if r == 1: ACC.clear()
            keys = eng.block_keys(range(16 * n), extra_keys=[f"wp-{r}"])
            await eng.put_kv(keys, kv)
            await eng.get_kv(keys, out=out)
        for k, v in ACC.items():
            v2 = [x for x in v]
            print(f"{k:20s} n={len(v):3d} median {statistics.median(v):8.1f} us  {[round(x) for x in v[:10]]}")
asyncio.run(main())
