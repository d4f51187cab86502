import asyncio, os, sys, time, uuid
import numpy as np
import tract_async as tract
async def main():
    lay = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=8, head_dim=32, dtype="float16")  # 64 KiB blocks
    path = f"/dev/shm/tract-bench-sp-{uuid.uuid4().hex[:6]}"
    try:
        async with tract.Engine.open(tract.EngineConfig(layout=lay, region=path, region_bytes=64 << 20,
                                                         create=True, node_id=0, namespace="sp")) as e:
            kv = np.ones(lay.kv_shape(1), dtype=np.float16)
            out = np.empty_like(kv)
            ts_put, ts_get = [], []
            for i in range(4000):   # 4000 x 64 KiB: the region (64 MiB) fills and evicts
                keys = e.block_keys(range(i * 16, i * 16 + 16))
                t0 = time.perf_counter(); await e.put_kv(keys, kv); t1 = time.perf_counter()
                await e.get_kv(keys, out=out); t2 = time.perf_counter()
                ts_put.append(t1 - t0); ts_get.append(t2 - t1)
            print(f"{sys.argv[1]} put p50 {np.median(ts_put[500:])*1e6:.1f} us  get p50 {np.median(ts_get[500:])*1e6:.1f} us  evictions {e.stats().get('evictions')}")
    finally:
        if os.path.exists(path): os.unlink(path)
        from tract_async.region import cpumarks
        cpumarks.remove(path, None)     # its sidecar (the first runs left these in /dev/shm)
asyncio.run(main())
