import asyncio, os, sys, tempfile, time, cProfile, pstats
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench")) if False else sys.path.insert(0, "/work/main/bench")
import _common as C
import numpy as np
import tract_async as tract
from tract_async.stores.txn import PutTxn, ReadTxn
from tract_async.cuda import store as cs
from tract_async.region.index import SNAP_POFF
async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s48p-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(1 << 30), create=True, remove_on_close=True, layout=lay, namespace="s48")
    async with tract.Engine.open(cfg) as eng:
        b = eng._store.blocks
        keys = eng.block_keys(range(16))
        txn = PutTxn(b, keys, None, None, "cuda"); await txn.begin(); txn.publish(lay.block_bytes)
        to = float(os.environ.get("TO", "0")) or None
        async def one():
            rt = ReadTxn(b, keys, 3, to, "cuda")
            snap = await rt.prepare()
            poffs = snap[:, SNAP_POFF].copy()
            await cs.invalidate_for_dma(b, poffs, 3)
            rt.validate(lay.layer_bytes, cpu=False)
        for _ in range(2000): await one()
        t0 = time.perf_counter_ns()
        for _ in range(5000): await one()
        print("per get metadata us", (time.perf_counter_ns() - t0) / 5000 / 1e3)
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5000): await one()
        pr.disable()
        st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(22)
asyncio.run(main())
