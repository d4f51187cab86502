import asyncio, os, sys, tempfile, time, statistics
import numpy as np
sys.path.insert(0, "/work/main/bench")
import _common as C
import tract_async as tract
from tract_async.keys import keys_to_words
def tm(f, n=200):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns(); f(); ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3
async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s51m-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(3 << 30), create=True, remove_on_close=True, layout=lay, namespace="s51m", mode="transfer")
    async with tract.Engine.open(cfg) as eng:
        b = eng._store.blocks
        keys = eng.block_keys(range(16 * 213))
        # make the node own chunks: one whole put through the CPU path
        kv = __import__("torch").zeros(lay.kv_shape(213), dtype=lay.dtype)
        await eng.put_kv(keys, kv)
        al = b.alloc
        print("owned chunks", len(al.owned_chunks()))
        print(f"owned_chunks  {tm(al.owned_chunks):8.1f} us")
        print(f"table.wanted  {tm(al.table.wanted):8.1f} us")
        print(f"keys_to_words {tm(lambda: keys_to_words(keys)):8.1f} us")
        g = b.reservation.giver if hasattr(b, 'reservation') else None
        print("ref", tm(lambda: sum(range(1000))))
asyncio.run(main())
