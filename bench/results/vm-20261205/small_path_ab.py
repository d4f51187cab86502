import asyncio, os, sys, time, json
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import numpy as np, torch
import tract_async as tract
from _putget.fixtures import BLOCK, det_keys, engine_cfg, make_kv, REGION_OVERHEAD
async def main():
    reps = 2000
    path = f"/dev/shm/tract-sab-{os.getpid()}"
    try:
      async with tract.Engine.open(engine_cfg(path, 0, (8 * reps + 64) * BLOCK + REGION_OVERHEAD, True)) as eng:
        kv = make_kv(1); out = torch.empty_like(kv)
        small = eng._small
        g = det_keys("g", 0, 1); await eng.put_kv(g, kv)
        ctr = iter(range(10**9))
        res = {}
        for rnd in range(3):
            for mode in ("fast", "full"):
                eng._small = small if mode == "fast" else None
                tp, tg = [], []
                for i in range(reps // 2):
                    k = det_keys("p", next(ctr), 1)
                    if i % 50 == 0: await asyncio.sleep(0.001)
                    t0 = time.perf_counter_ns(); await eng.put_kv(k, kv); t1 = time.perf_counter_ns()
                    await eng.get_kv(g, out=out); t2 = time.perf_counter_ns()
                    tp.append(t1 - t0); tg.append(t2 - t1)
                res.setdefault(mode, []).append((round(np.median(tp) / 1e3, 2), round(np.median(tg) / 1e3, 2)))
        eng._small = small
        print(json.dumps(res), eng.stats()["small_puts"], eng.stats()["small_gets"])
    finally:
        if os.path.exists(path): os.unlink(path)
asyncio.run(main())
