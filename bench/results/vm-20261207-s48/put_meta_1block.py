import asyncio, os, sys, tempfile, time, cProfile, pstats
sys.path.insert(0, "/work/main/bench")
import _common as C
import tract_async as tract
from tract_async.stores.txn import PutTxn
async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s48p-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(1 << 30), create=True, remove_on_close=True, layout=lay, namespace="s48")
    async with tract.Engine.open(cfg) as eng:
        b = eng._store.blocks
        r = [0]
        async def request():
            r[0] += 1
            keys = eng.block_keys(range(r[0] * 10**5, r[0] * 10**5 + 16))
            t = 0
            for i in range(lay.num_layers):
                t0 = time.perf_counter_ns()
                txn = PutTxn(b, keys, i, None, "cuda")
                if not txn.resume():
                    await txn.begin()
                poffs = txn.offsets(); b.alloc.check_not_fenced()
                txn.publish(lay.layer_bytes)
                if i: t += time.perf_counter_ns() - t0
            await b.evict(keys)
            return t / (lay.num_layers - 1)
        for _ in range(50): await request()
        ts = [await request() for _ in range(200)]
        ts.sort(); print("per later-layer put metadata us", ts[len(ts)//2] / 1e3)
        if os.environ.get("PROF"):
            pr = cProfile.Profile(); pr.enable()
            for _ in range(200): await request()
            pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
asyncio.run(main())
