import asyncio, os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch, numpy as np
import tract_async as tract
from _putget.fixtures import LAYOUT, BLOCK, det_keys, engine_cfg, make_kv, MiB, REGION_OVERHEAD

async def main():
    nb = int(sys.argv[1]) if len(sys.argv) > 1 else 16 * MiB
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    path = f"/dev/shm/tract-prof-{os.getpid()}"
    n = nb // BLOCK
    region_bytes = (2 * reps + 2) * nb + REGION_OVERHEAD
    async with tract.Engine.open(engine_cfg(path, 0, region_bytes, True)) as eng:
        ph = eng.time_phases(True)
        kv = make_kv(n)
        out = torch.empty_like(kv)
        rows = []
        for mode in ("block", "layers"):
            for i in range(reps):
                keys = det_keys(mode, i, n)
                ph.take()
                t0 = time.perf_counter_ns()
                if mode == "block":
                    await eng.put_kv(keys, kv)
                else:
                    for l in range(LAYOUT.num_layers):
                        await eng.put_kv(keys, kv[l], layer=l)
                t1 = time.perf_counter_ns()
                pp = ph.take()
                if mode == "block":
                    await eng.get_kv(keys, out=out)
                else:
                    for l in range(LAYOUT.num_layers):
                        await eng.get_kv(keys, layer=l, out=out[l])
                t2 = time.perf_counter_ns()
                gp = ph.take()
                rows.append((mode, (t1-t0)/1e3, (t2-t1)/1e3, {k: round(v*1e6) for k, v in pp.items()}, {k: round(v*1e6) for k, v in gp.items()}))
        for r in rows: print(r)
    if os.path.exists(path): os.unlink(path)
asyncio.run(main())
