"""Remote frees (ring pushes) and drains, with and without a thread that wants the GIL."""
import asyncio, os, statistics, sys, tempfile, threading, time
sys.path.insert(0, "/work/main/bench")
import _common as C
import tract_async as tract

def contender(stop):
    while not stop.is_set():
        time.sleep(20e-6)
        sum(range(50))

async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s50r-", dir="/dev/shm")
    common = dict(region=path, layout=lay)
    e0 = await tract.Engine.open(tract.EngineConfig(**common, region_bytes=1 << 30, create=True, remove_on_close=True, node_id=0))
    e1 = await tract.Engine.open(tract.EngineConfig(**common, node_id=1))
    try:
        a0, a1 = e0._store.blocks.alloc, e1._store.blocks.alloc
        lock = e0._store.blocks.lock
        for cont in (False, True, False, True):
            stop = threading.Event()
            th = threading.Thread(target=contender, args=(stop,), daemon=True)
            if cont: th.start()
            fr, dr = [], []
            for r in range(30):
                await lock.acquire() if asyncio.iscoroutinefunction(lock.acquire) else lock.acquire()
                try:
                    allocs = a0.alloc_many_locked(lay.block_bytes // 32, 64, lock)
                finally:
                    lock.release()
                t = time.perf_counter_ns(); a1.free_many(allocs); t1 = time.perf_counter_ns()
                a0.drain_returns(); t2 = time.perf_counter_ns()
                fr.append((t1 - t) / 64 / 1e3); dr.append((t2 - t1) / 64 / 1e3)
            stop.set()
            print(f"contender={cont}: remote free {statistics.median(fr):.2f} us/slot, drain {statistics.median(dr):.2f} us/slot")
    finally:
        await e1.close(); await e0.close()
asyncio.run(main())
