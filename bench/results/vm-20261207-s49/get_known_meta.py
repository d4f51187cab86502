"""A later layer's read metadata on the CPU, the two ways a CUDA layer stream can prepare it:
ReadTxn.prepare (the key lookup, or the known slots above 8 blocks) against
ReadTxn.prepare_known (the first layer's rows kept), then invalidate_for_dma and validate, as
cuda/store.py's get_layer runs them (no CUDA call). Alternating rounds; median us per op."""
import asyncio, os, statistics, sys, tempfile, time
sys.path.insert(0, "/work/main/bench")
import _common as C
import tract_async as tract
from tract_async.stores.txn import PutTxn, ReadTxn
from tract_async.cuda import store as cs
from tract_async.region.index import SNAP_POFF


async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s49k-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(1 << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="s49")
    async with tract.Engine.open(cfg) as eng:
        b = eng._store.blocks
        for n in (1, 32):
            keys = eng.block_keys(range(16 * n), extra_keys=[f"n{n}"])
            txn = PutTxn(b, keys, None, None, "cuda"); await txn.begin()
            txn.publish(n * lay.block_bytes)
            t0 = ReadTxn(b, keys, 0, None, "cuda")
            rows = (await t0.prepare()).copy()
            words = t0.words
            poffs = rows[:, SNAP_POFF].copy()

            async def whole():
                rt = ReadTxn(b, keys, 3, None, "cuda", words=words)
                snap = await rt.prepare()
                p = snap[:, SNAP_POFF]
                assert (p == poffs).all()
                await cs.invalidate_for_dma(b, poffs, 3)
                rt.validate(n * lay.layer_bytes, cpu=False)

            async def known():
                rt = ReadTxn(b, keys, 3, None, "cuda", words=words)
                assert rt.prepare_known(rows)
                await cs.invalidate_for_dma(b, poffs, 3)
                rt.validate(n * lay.layer_bytes, cpu=False)

            res = {"whole": [], "known": []}
            for fn in (whole, known):
                for _ in range(500):
                    await fn()
            ways = (("whole", whole), ("known", known))
            if os.environ.get("ORDER") == "known-first":     # get_known_meta_swapped.log
                ways = ways[::-1]
            for r in range(10):
                for name, fn in ways:
                    t = time.perf_counter_ns()
                    for _ in range(1000):
                        await fn()
                    res[name].append((time.perf_counter_ns() - t) / 1000 / 1e3)
            print(f"{n} blocks: prepare+invalidate+validate us, median of 10 x 1000: "
                  f"whole path {statistics.median(res['whole']):.1f}, "
                  f"kept rows {statistics.median(res['known']):.1f}", flush=True)

asyncio.run(main())
