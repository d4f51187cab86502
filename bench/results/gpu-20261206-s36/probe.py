"""Device diagnostic: cudaMemcpy2DAsync host cost and speed, and where a layer op's host time goes."""
import asyncio, cProfile, ctypes, io, os, pstats, sys, time
import numpy as np, torch
import tract_async as tract
from tract_async.cuda.hostreg import cudart_lib
from tract_async.cuda import direct
pc = time.perf_counter
lib = cudart_lib(); f2d = lib.cudaMemcpy2DAsync
f1d = lib.cudaMemcpyAsync; f1d.restype = ctypes.c_int
f1d.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream(); h = s.cuda_stream
W, P = 32 << 10, 2 << 20
def bench(label, fn, reps=100):
    torch.cuda.synchronize(); t0 = pc()
    for _ in range(reps): fn()
    t1 = pc(); s.synchronize(); t2 = pc()
    print(f"{label:44s} host {1e6*(t1-t0)/reps:8.1f} us/call  total {1e6*(t2-t0)/reps:8.1f} us/call", flush=True)
for rows in (1, 8, 32, 213):
    bench(f"2D D2H {rows} rows x 32K pitch 2M", lambda: f2d(host.data_ptr(), P, dev.data_ptr(), W, W, rows, 4, h))
    bench(f"2D H2D {rows} rows x 32K pitch 2M", lambda: f2d(dev.data_ptr(), W, host.data_ptr(), P, W, rows, 4, h))
    bench(f"1D D2H {rows} x 32K contiguous (one call)", lambda: f1d(host.data_ptr(), dev.data_ptr(), W * rows, 4, h))
    bench(f"1D D2H per row x{rows} calls", lambda: [f1d(host.data_ptr() + i * P, dev.data_ptr() + i * W, W, 4, h) for i in range(rows)], reps=20)
bench("Event()+record", lambda: torch.cuda.Event().record(s), reps=1000)
bench("current_stream()", lambda: torch.cuda.current_stream(), reps=1000)
del host
lay = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
async def main():
    path = f"/dev/shm/tract-probe-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=12 << 30, create=True, remove_on_close=True,
                             layout=lay, mode="transfer", namespace="probe")
    async with tract.Engine.open(cfg) as eng:
        eng.cuda_setup()
        for n in (32, 213):
            kv = torch.randn(lay.kv_shape(n), device="cuda").to(lay.dtype)
            out = torch.empty_like(kv)
            prof = cProfile.Profile()
            for r in range(4):
                keys = eng.block_keys(list(range(n * 16)), extra_keys=[f"p{n}-{r}"])
                if r == 3: prof.enable()
                t0 = pc()
                for i in range(32):
                    fut = await eng.start_put_kv(keys, kv[i], layer=i); await fut
                t1 = pc()
                for i in range(32):
                    fut = await eng.start_get_kv(keys, out=out[i], layer=i); await fut
                t2 = pc()
                if r == 3: prof.disable()
                st = eng._store.blocks
                b = st.filling(keys)
                print(f"n={n} round {r}: puts {1e6*(t1-t0)/32:.0f} us/layer gets {1e6*(t2-t1)/32:.0f} us/layer exact={torch.equal(out, kv)}", flush=True)
                await eng.get_kv(keys, device="cuda")        # consume
            poffs = eng._store.blocks.index.snapshot(__import__('tract_async.keys', fromlist=['x']).keys_to_words(keys))[:, 3]
            segs = direct.segments(poffs, lay.layer_bytes)
            print(f"n={n}: segments {segs.shape[0]}, strides {sorted(set(np.diff(poffs).tolist()))[:6]}", flush=True)
            sio = io.StringIO(); pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(22); print(sio.getvalue()[-5000:])
        print(eng.stats()["cuda"]["devices"])
asyncio.run(main())
