"""A whole-prompt CUDA put's and get's start on the CPU (cuda/store.py's start_put / start_get,
the direct branch), with a stand-in copier (no cudart call): where 213 blocks x 32 layers of
host work go before the first copy would be enqueued. Throwaway profile harness."""
import asyncio, cProfile, os, pstats, statistics, sys, tempfile, time
import numpy as np, torch
sys.path.insert(0, "/work/main/bench")
import _common as C
import tract_async as tract
from tract_async.cuda import store as cs, layerstream as ls, direct
from tract_async.cuda.store import CudaPath

class Ev:
    def query(self): return True
    def synchronize(self): pass

class FakeCopier:
    device = torch.device("cpu")
    def __init__(self, lay): self.lay = lay; self.tc = direct.TemplateCache(lay, 0)
    def wants_direct(self, method): return True
    def direct_template(self, layout, poffs, whole): return self.tc.get(poffs, whole)
    def put_direct(self, dc, t, ready): return Ev(), (t,)
    def get_direct(self, dc, t, after): return Ev(), (t,)

class P:
    registered = True
    def __init__(self, cop):
        self.streams = ls.Streams(); self.futures_created = 0; self._outstanding = set()
        self.validation_failures = 0; self.cop = cop
    def copier(self, dev): return self.cop
    track = CudaPath.track

async def main(n, prof):
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s51w-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(3 << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="s50w", mode="transfer")
    async with tract.Engine.open(cfg) as eng:
        store = eng._store; b = store.blocks
        from tract_async.region import cpumarks, index as ix
        sw = cpumarks.Sweeper(b.cpu_marks, b.mem, ix.S_IX_PAYLOAD_READ); sw.done.wait(60)
        cp = P(FakeCopier(lay))
        L0 = os.environ.get("L0") == "1"
        kv = torch.zeros(lay.kv_shape(n, 0) if L0 else lay.kv_shape(n), dtype=lay.dtype)
        lay_arg = 0 if L0 else None
        pr = cProfile.Profile()
        ts = {"put": [], "get": []}
        for r in range(12):
            keys = eng.block_keys(range(r * 1_000_000, r * 1_000_000 + 16 * n))
            if r >= 2 and prof and os.environ.get("OP", "put") == "put": pr.enable()
            t0 = time.perf_counter_ns()
            fut = await cs.start_put(store, cp, keys, [kv], cs.contiguous_plan_fn(lay, n, lay_arg), lay_arg, None)
            t1 = time.perf_counter_ns()
            pr.disable()
            await fut
            t2 = time.perf_counter_ns()
            if r >= 2 and prof and os.environ.get("OP") == "get": pr.enable()
            fut = await cs.start_get(store, cp, keys, [kv], cs.contiguous_plan_fn(lay, n, lay_arg), lay_arg, None, result=kv)
            t3 = time.perf_counter_ns()
            pr.disable()
            await cs.finish_get(store, cp, keys, fut, lay_arg)
            if L0:
                await store.blocks.abandon(keys)
            t4 = time.perf_counter_ns()
            if r >= 2:
                ts["put"].append(((t1 - t0) / 1e3, (t2 - t1) / 1e3)); ts["get"].append(((t3 - t2) / 1e3, (t4 - t3) / 1e3))
            await store.blocks.drain_consumed()
            store.blocks  # keep
            # free the blocks for the next round (transfer of ownership not needed: cache mode evicts LRU)
        for op, v in ts.items():
            print(f"{n} blocks whole {op}: start {statistics.median([a for a, _ in v]):.0f} us, completion {statistics.median([c for _, c in v]):.0f} us")
        if prof:
            st = pstats.Stats(pr)
            rows = sorted(((ct, tt, nc, f"{fn.split('/work/main/')[-1]}:{ln}({nm})") for (fn, ln, nm), (cc, nc, tt, ct, _) in st.stats.items()), reverse=True)
            for ct, tt, nc, name in rows[:40]:
                print(f"{ct*1e6/10:8.1f} {tt*1e6/10:8.1f} {nc/10:5.1f}  {name}")
if __name__ == "__main__": asyncio.run(main(int(sys.argv[1]), len(sys.argv) > 2))
