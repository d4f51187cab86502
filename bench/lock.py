"""Global-lock benchmark: uncontended acquire+release, 2 and 4 contending processes, manager CPU
while idle. Baseline measured in the same run: an in-process asyncio.Lock. One run, a printed
table, JSON under bench/results/lock-<time>-<commit>.json.

    python bench/lock.py [--backend hw|sim] [--cycles 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import pct, table, write_json  # noqa: E402
from tests.support import procs_lock as P  # noqa: E402
from tests.sync.test_lock import run_counter  # noqa: E402
from tract_async.sync import GlobalLock, LockManager, heartbeat_forever  # noqa: E402


async def _uncontended(path: str, backend: str, cycles: int) -> dict:
    r = P.make_region(path, backend)
    try:
        h = r.nodes.join(0)
        lock = GlobalLock(r, h)
        mgr = LockManager(r, h, liveness_timeout_s=1.0)
        async with asyncio.TaskGroup() as tg:
            beat = tg.create_task(heartbeat_forever(r, h, interval_s=0.1))
            run = tg.create_task(mgr.run())
            while not mgr.is_manager:                 # ``elected`` is a threading.Event (the
                await asyncio.sleep(0.005)            # manager may run on its own thread)
            for _ in range(200):                      # warm up (JIT cache load, thread pool)
                await lock.acquire(timeout=10)
                lock.release()
            lat = []
            for _ in range(cycles):
                t0 = time.perf_counter()
                await lock.acquire(timeout=10)
                lock.release()
                lat.append(time.perf_counter() - t0)
            # manager CPU while idle: nobody requests for 3 s
            await asyncio.sleep(0.5)
            c0, w0 = time.process_time(), time.perf_counter()
            await asyncio.sleep(3.0)
            idle_cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
            # first acquire after the idle period (manager in its sleeping phase)
            t0 = time.perf_counter()
            await lock.acquire(timeout=10)
            lock.release()
            wake = time.perf_counter() - t0
            beat.cancel()
            run.cancel()
        lock.close()
        base = asyncio.Lock()
        blat = []
        for _ in range(cycles):
            t0 = time.perf_counter()
            await base.acquire()
            base.release()
            blat.append(time.perf_counter() - t0)
        return {"p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6,
                "idle_cpu_cores": idle_cpu, "wake_after_idle_us": wake * 1e6,
                "baseline_asyncio_lock_p50_us": pct(blat, 50) * 1e6}
    finally:
        r.close()
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="hw", choices=["hw", "sim"])
    ap.add_argument("--cycles", type=int, default=2000)
    args = ap.parse_args()
    rows = []
    path = f"/dev/shm/tract-bench-lock-{uuid.uuid4().hex[:8]}"
    un = asyncio.run(_uncontended(path, args.backend, args.cycles))
    rows.append({"case": "1 proc, uncontended (mgr in-proc)", "p50_us": un["p50_us"],
                 "p99_us": un["p99_us"], "ops_per_s": 1e6 / un["p50_us"]})
    rows.append({"case": "baseline: asyncio.Lock in-proc", "p50_us":
                 un["baseline_asyncio_lock_p50_us"], "p99_us": float("nan"), "ops_per_s": float("nan")})
    for n in (2, 4):
        path = f"/dev/shm/tract-bench-lock-{uuid.uuid4().hex[:8]}"
        try:
            t0 = time.perf_counter()
            value, reps = run_counter(path, args.backend, nodes=n, cycles=args.cycles)
            assert value == n * args.cycles, value
            el = max(r["elapsed"] for r in reps)
            rows.append({"case": f"{n} procs contending (+mgr in node 0)",
                         "p50_us": sorted(r["p50"] for r in reps)[n // 2] * 1e6,
                         "p99_us": max(r["p99"] for r in reps) * 1e6,
                         "ops_per_s": n * args.cycles / el, "wall_s": time.perf_counter() - t0})
        finally:
            if os.path.exists(path):
                os.unlink(path)
    print(table(rows, ["case", "p50_us", "p99_us", "ops_per_s"]))
    print(f"manager CPU while idle: {un['idle_cpu_cores'] * 100:.1f} % of one core "
          f"(whole process, incl. heartbeats); first acquire after 3 s idle: "
          f"{un['wake_after_idle_us']:.0f} us")
    out = write_json("lock" if args.backend == "hw" else "lock-sim",
                     {"backend": args.backend, "cycles": args.cycles, "rows": rows,
                      "uncontended": un})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
