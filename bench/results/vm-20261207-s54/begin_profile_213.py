import asyncio, os, time, cProfile, pstats, io, statistics
import numpy as np
import tract_async as tract
from tract_async.engine import run
from tract_async.region.region import discard
from tract_async.stores.txn import PutTxn
from tract_async.keys import keys_to_words
LAY = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype="float16")
async def main():
    path=f"/dev/shm/tract-prof-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=1200 << 20, create=True, node_id=0, layout=LAY, namespace="p", mem_backend="hw")
    try:
        async with tract.Engine.open(cfg) as eng:
            b = eng._store.blocks
            ts=[]
            pr = cProfile.Profile()
            for r in range(30):
                keys = eng.block_keys([(r*7919+i) % 50000 + r*100000 for i in range(213*16)])
                words = keys_to_words(keys)
                t=time.perf_counter()
                if r >= 10: pr.enable()
                st = PutTxn(b, keys, None, 5.0, "cuda", words=words)
                await st.begin()
                if r >= 10: pr.disable()
                ts.append(time.perf_counter()-t)
                await st.abandon()
            print("begin µs median (first 10 unprofiled):", [round(x*1e6) for x in ts[:10]], statistics.median(ts[2:10])*1e6)
            s=io.StringIO(); pstats.Stats(pr,stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:5000])
    finally:
        discard(path)
run(main())
