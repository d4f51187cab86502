"""Device diagnostic (session 37): where a later layer's put / get host time goes, step by step."""
import asyncio, cProfile, ctypes, io, os, pstats, sys, time
import numpy as np, torch
import tract_async as tract
from tract_async.cuda.hostreg import cudart_lib
from tract_async.cuda import direct, store as cs
from tract_async.stores import plan as kvplan
from tract_async.cuda.events import DONE
pc = time.perf_counter

def tm(label, fn, reps=2000):
    try:
        fn()
        t0 = pc()
        for _ in range(reps): fn()
        dt = (pc() - t0) / reps
        print(f"  {label:58s} {1e6*dt:8.2f} us", flush=True)
    except Exception as e:
        print(f"  {label:58s} ERROR {type(e).__name__}: {e}", flush=True)

async def atm(label, fn, reps=500):
    try:
        await fn()
        t0 = pc()
        for _ in range(reps): await fn()
        dt = (pc() - t0) / reps
        print(f"  {label:58s} {1e6*dt:8.2f} us", flush=True)
    except Exception as e:
        print(f"  {label:58s} ERROR {type(e).__name__}: {e}", flush=True)

lib = cudart_lib()
print("python", sys.version.split()[0], "torch", torch.__version__, flush=True)
s = torch.cuda.Stream(); h = s.cuda_stream
print("raw primitives:")
tm("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
tm("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(torch.device('cuda', 0)))
tm("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
tm("torch.cuda.Event()", lambda: torch.cuda.Event())
ev = torch.cuda.Event()
tm("ev.record(s)", lambda: ev.record(s))
tm("ev.query()", lambda: ev.query())
tm("s.wait_event(ev)", lambda: s.wait_event(ev))
try:
    evh = ctypes.c_void_p()
    lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    print("  cudaEventCreateWithFlags ->", lib.cudaEventCreateWithFlags(ctypes.byref(evh), 2))
    rec = lib.cudaEventRecord; rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]; rec.restype = ctypes.c_int
    q = lib.cudaEventQuery; q.argtypes = [ctypes.c_void_p]; q.restype = ctypes.c_int
    w = lib.cudaStreamWaitEvent; w.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]; w.restype = ctypes.c_int
    e = evh.value
    tm("ctypes cudaEventRecord", lambda: rec(e, h))
    tm("ctypes cudaEventQuery", lambda: q(e))
    tm("ctypes cudaStreamWaitEvent", lambda: w(h, e, 0))
except Exception as ex:
    print("  raw events ERROR", ex)
lay = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16)

async def main():
    path = f"/dev/shm/tract-probe2-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=8 << 30, create=True, remove_on_close=True,
                             layout=lay, mode="transfer", namespace="probe2")
    async with tract.Engine.open(cfg) as eng:
        cp = eng.cuda_setup()
        b = eng._store.blocks
        for n in (1, 32, 213):
            print(f"== n={n}", flush=True)
            kv = torch.randn(lay.kv_shape(n), device="cuda").to(lay.dtype)
            out = torch.empty_like(kv)
            keys = eng.block_keys(list(range(n * 16)), extra_keys=[f"p2-{n}"])
            f = await eng.start_put_kv(keys, kv[0], layer=0); await f
            copier = cp.copier(kv.device)
            k5 = kv[5]; o5 = out[5]
            tm("kv[5] (tensor index)", lambda: kv[5])
            tm("check_keys", lambda: kvplan.check_keys(keys))
            tm("check_layer", lambda: kvplan.check_layer(5, lay))
            tm("check_tensor", lambda: kvplan.check_tensor(k5, lay, n, 5, what="kv", allow_cuda=True))
            tm("filling(keys)", lambda: b.filling(keys))
            res = b.filling(keys)
            poffs = b.payload_offsets(res)
            tm("cpath.copier(dev)", lambda: cp.copier(k5.device))
            tm("copier.wants_direct", lambda: copier.wants_direct(None))
            tm("direct.plan", lambda: direct.plan(lay, poffs, 5, k5.data_ptr(), copier.region_ptr))
            tm("copier.direct_plan (cached)", lambda: copier.direct_plan(lay, poffs, 5, k5.data_ptr()))
            if copier.fast is not None:
                tm("fast.current_raw_stream", lambda: copier.fast.current_raw_stream(0))
                tm("put order.after_current", lambda: copier._put_order.after_current(copier._put_dma_h))
                tm("events.take().record + release", lambda: copier.events.take().record(copier._put_dma_h).release())
            else:
                print("  copier.fast is None: torch events")
            dc = direct.plan(lay, poffs, 5, k5.data_ptr(), copier.region_ptr)
            tm("copier.producer_event(None)", lambda: copier.producer_event(None))
            tm("direct.issue (put)", lambda: direct.issue(dc, copier._put_dma_h, to_region=True), reps=300)
            torch.cuda.synchronize()
            tm("copier.put_direct(dc, k5, None)", lambda: copier.put_direct(dc, k5, None), reps=300)
            torch.cuda.synchronize()
            tm("StreamFuture(done)", lambda: cs.StreamFuture(DONE, completion=lambda: 0, label="x"))
            # whole later-layer start_put (re-puts layers 1..31 cyclically: same bytes)
            i = [1]
            async def sp():
                L = i[0]; i[0] = L % 30 + 1
                fut = await eng.start_put_kv(keys, kv[L], layer=L)
                return fut
            futs = []
            async def sp_only():
                futs.append(await sp())
            await atm("start_put_kv later layer (host, not awaited)", sp_only, reps=200)
            for f in futs: await f
            async def sp_await():
                await (await sp())
            await atm("start_put_kv + await", sp_await, reps=200)
            # finish all layers so gets see everything
            for L in range(1, 32):
                await (await eng.start_put_kv(keys, kv[L], layer=L))
            tm("b.filling after READY", lambda: b.filling(keys))
            await atm("b.prepare_read(keys, 5)", lambda: b.prepare_read(keys, 5, None))
            words, snap = await b.prepare_read(keys, 5, None)
            gpo = snap[:, 3].copy()
            await atm("invalidate_for_dma", lambda: cs.invalidate_for_dma(b, gpo, 5))
            dcg = direct.plan(lay, gpo, 5, o5.data_ptr(), copier.region_ptr)
            tm("copier.get_direct(dcg, o5, None)", lambda: copier.get_direct(dcg, o5, None), reps=300)
            torch.cuda.synchronize()
            tm("b.validate_read", lambda: b.validate_read(keys, words, snap, dcg.nbytes, cpu=False))
            j = [0]
            async def sg_only():
                L = j[0]; j[0] = (L + 1) % 32
                futs.append(await eng.start_get_kv(keys, out=out[L], layer=L))
            futs = []
            await atm("start_get_kv (host, not awaited)", sg_only, reps=200)
            for f in futs: await f
            async def sg_await():
                L = j[0]; j[0] = (L + 1) % 32
                await (await eng.start_get_kv(keys, out=out[L], layer=L))
            await atm("start_get_kv + await", sg_await, reps=200)
            prof = cProfile.Profile(); prof.enable()
            for _ in range(100):
                await sp_await(); await sg_await()
            prof.disable()
            sio = io.StringIO(); pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(30)
            print(sio.getvalue()[-6500:], flush=True)
            await eng.get_kv(keys, device="cuda")
asyncio.run(main())
