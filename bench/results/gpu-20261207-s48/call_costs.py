import asyncio, os, sys, tempfile, time, statistics as S
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import _common as C
import numpy as np
import tract_kernels as K
import tract_async as tract
pc = time.perf_counter_ns
async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s48-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(1 << 30), create=True, remove_on_close=True, layout=lay, namespace="s48")
    async with tract.Engine.open(cfg) as eng:
        a = eng._store.blocks.alloc
        m = a._region.mem
        off = a.geo.count_off(a.node_id) + 8
        site = 0
        from tract_async.region.alloc import S_COUNT_READ
        T = {}
        for _ in range(2000):
            t0 = pc(); a.check_not_fenced(); T.setdefault("check_not_fenced", []).append(pc() - t0)
            t0 = pc(); K.load_fresh(m, off, S_COUNT_READ); T.setdefault("load_fresh", []).append(pc() - t0)
            t0 = pc(); K.load(m, off); T.setdefault("load", []).append(pc() - t0)
            t0 = pc(); a.geo.count_off(a.node_id); T.setdefault("count_off", []).append(pc() - t0)
            t0 = pc(); time.perf_counter(); T.setdefault("perf_counter", []).append(pc() - t0)
        try:
            import torch
            if torch.cuda.is_available():
                from tract_async.cuda import events
                fc = events.fast_calls()
                pool = events.EventPool(fc, torch.device("cuda", 0))
                ev = pool.take()
                s_ = torch.cuda.Stream()
                h = int(s_.cuda_stream)
                ev.record(h); torch.cuda.synchronize()
                for _ in range(2000):
                    t0 = pc(); ev.query(); T.setdefault("event_query", []).append(pc() - t0)
                    t0 = pc(); ev.record(h); T.setdefault("event_record", []).append(pc() - t0)
                    t0 = pc(); fc.current_raw_stream(0); T.setdefault("current_raw_stream", []).append(pc() - t0)
                    t0 = pc(); ev.wait_on(h); T.setdefault("stream_wait_event", []).append(pc() - t0)
        except Exception as e:
            print("cuda part:", e)
        print("  ".join(f"{k} {S.median(v)/1e3:.2f}us" for k, v in T.items()))
asyncio.run(main())
