import asyncio, os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import numpy as np, torch
import tract_async as tract
from tract_async.keys import keys_to_words
from tract_async import arrays
from _putget.fixtures import BLOCK, det_keys, engine_cfg, make_kv, REGION_OVERHEAD
async def main():
    reps = 3000
    path = f"/dev/shm/tract-lb-{os.getpid()}"
    try:
      async with tract.Engine.open(engine_cfg(path, 0, (6 * reps + 64) * BLOCK + REGION_OVERHEAD, True)) as eng:
        st = eng._store; b = st.blocks
        kv = make_kv(1); out = torch.empty_like(kv)
        ctr = iter(range(10**9))
        def K(): return det_keys("x", next(ctr), 1)
        keys = [K() for _ in range(6 * reps)]
        it = iter(keys)
        tm = st._template(1); src = kv.data_ptr()
        res = {}
        async def t_engine():
            k = next(it); t0 = time.perf_counter_ns(); await eng.put_kv(k, kv); return time.perf_counter_ns() - t0
        async def t_store():
            k = next(it); t0 = time.perf_counter_ns(); await st.put(k, kv, None, None); return time.perf_counter_ns() - t0
        async def t_fused():
            k = next(it); t0 = time.perf_counter_ns(); b.put_fused(k, keys_to_words(k), src, tm); return time.perf_counter_ns() - t0
        async def t_fused_nowords():
            k = next(it); w = keys_to_words(k); t0 = time.perf_counter_ns(); b.put_fused(k, w, src, tm); return time.perf_counter_ns() - t0
        async def t_words():
            k = next(it); t0 = time.perf_counter_ns(); keys_to_words(k); return time.perf_counter_ns() - t0
        g = det_keys("g", 0, 1); await eng.put_kv(g, kv); gw = keys_to_words(g); dst = out.data_ptr()
        async def t_get_engine():
            t0 = time.perf_counter_ns(); await eng.get_kv(g, out=out); return time.perf_counter_ns() - t0
        async def t_get_store():
            t0 = time.perf_counter_ns(); await st.get(g, out, None, None); return time.perf_counter_ns() - t0
        async def t_get_fused():
            t0 = time.perf_counter_ns(); b.get_fused(g, gw, dst, tm); return time.perf_counter_ns() - t0
        for name, f in [("put engine", t_engine), ("put store", t_store), ("put_fused+words", t_fused), ("put_fused", t_fused_nowords), ("keys_to_words", t_words),
                        ("get engine", t_get_engine), ("get store", t_get_store), ("get_fused", t_get_fused)]:
            ts = [await f() for _ in range(reps // 2)]
            res[name] = round(float(np.median(ts)) / 1e3, 2)
        print(res)
    finally:
        if os.path.exists(path): os.unlink(path)
asyncio.run(main())
