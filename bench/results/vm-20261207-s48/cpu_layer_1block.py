import asyncio, os, sys, tempfile, time
sys.path.insert(0, "/work/main/bench")
import _common as C
import numpy as np
import tract_async as tract
async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s48c-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(1 << 30), create=True, remove_on_close=True, layout=lay, namespace="s48")
    async with tract.Engine.open(cfg) as eng:
        kv = [np.random.default_rng(i).integers(0, 255, size=lay.layer_bytes, dtype=np.uint8).view(np.uint16).reshape(lay.kv_shape(1, 0)) for i in range(lay.num_layers)]
        out = np.empty_like(kv[0])
        b = eng._store.blocks
        P, G = [], []
        for r in range(300):
            keys = eng.block_keys(range(r * 10**5, r * 10**5 + 16))
            for i in range(lay.num_layers):
                t0 = time.perf_counter_ns(); await eng.put_kv(keys, kv[i], layer=i); t1 = time.perf_counter_ns()
                if i and r >= 50: P.append(t1 - t0)
            for i in range(lay.num_layers):
                t0 = time.perf_counter_ns(); await eng.get_kv(keys, out=out, layer=i); t1 = time.perf_counter_ns()
                if i and r >= 50: G.append(t1 - t0)
            await b.evict(keys)
        P.sort(); G.sort()
        print(f"cpu 1-block layer put {P[len(P)//2]/1e3:.1f} us  get {G[len(G)//2]/1e3:.1f} us")
asyncio.run(main())
