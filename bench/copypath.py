"""The CPU copy back-end (``tract_async/stores/cpucopy.py``) by size and thread count.

Where a layer's copy spends its time: the jitted kernel called on the caller's thread (no hop),
the same kernel on one worker thread (one hop: submit, wake a worker, wake the loop when done),
and the copy cut into 2-16 row groups on as many pool threads and on a ``CopyGang`` of as many
GIL-free workers (``stores/copygang.py``), against torch ``copy_`` of the same
bytes between two private buffers (default threads) in the same run. The plan is a layer's: rows
of 16 KiB (one layer of a 64 KiB block: K and V of 8 KiB, adjacent in the region) 64 KiB apart
in the region, contiguous in the tensor -- what ``put_kv(keys, kv[l], layer=l)`` copies.

Floor, written before measuring: a copy of S bytes on t threads costs S / min(t * one thread's
bandwidth, the socket's) plus the hop. On the H200 host one thread writes (non-temporal) at
~10-14 GB/s and reads (invalidate, then read: every line from DRAM) at ~5 GB/s, the socket gives
~40 GB/s to torch; a hop costs ~50-150 µs. So a 4 MiB layer read takes ~0.8 ms on one thread
and should take ~0.25-0.3 ms on four; a 1 MiB copy gains nothing from a second thread.
``threads_for`` encodes that (one thread per MiB, from 2 MiB, at most ``copy_threads``).

Run: ``python bench/copypath.py [--quick] [--max-threads N]``. Writes
``bench/results/copypath-<time>-<commit>.json`` (machine details, every sample). The region is a /dev/shm file of
this run and is removed on exit.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, Awaitable, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import tract_async as tract  # noqa: E402
from tract_async.region import Region  # noqa: E402
from tract_async.region import index as ix  # noqa: E402
from tract_async.stores import cpucopy  # noqa: E402

MiB = 1 << 20
ROW = 16 << 10          # one layer of a 64 KiB block
STRIDE = 64 << 10       # the next block's payload


def layer_plan(nbytes: int, region_base: int) -> np.ndarray:
    """Plan rows (region offset, tensor offset, bytes) of one layer of ``nbytes // ROW`` blocks."""
    n = nbytes // ROW
    plan = np.empty((n, 3), dtype=np.int64)
    plan[:, 0] = region_base + np.arange(n, dtype=np.int64) * STRIDE
    plan[:, 1] = np.arange(n, dtype=np.int64) * ROW
    plan[:, 2] = ROW
    return plan


async def timed(fn: Callable[[], Awaitable[Any]], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        await fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def sync_timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


async def run(sizes: list[int], thread_counts: list[int], reps: int) -> dict[str, Any]:
    path = f"/dev/shm/tract-bench-copypath-{os.getpid()}"
    biggest = max(sizes)
    region = Region.create(path, (biggest // ROW) * STRIDE + 64 * MiB, max_nodes=2)
    try:
        base = region.data_offset
        copier = cpucopy.CpuCopier(region, copy_threads=max(thread_counts), gang=False)
        ganged = cpucopy.CpuCopier(region, copy_threads=max(thread_counts))
        auto = cpucopy.auto_copy_threads()
        src = torch.empty(biggest, dtype=torch.uint8)
        src.copy_(torch.randint(0, 256, (biggest,), dtype=torch.uint8))
        dst = torch.empty(biggest, dtype=torch.uint8)
        rows: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        hop = await timed(lambda: loop.run_in_executor(copier._copy_pool(), int), 200)
        for s in sizes:
            plan = layer_plan(s, base)
            sa, da = src.data_ptr(), dst.data_ptr()
            r = max(3, reps * 4 * MiB // max(s, 4 * MiB))
            t_torch = sync_timed(lambda: dst[:s].copy_(src[:s]), r)
            row: dict[str, Any] = {"size": C.human_bytes(s), "bytes": s, "reps": r,
                                   "torch_us": C.median(t_torch)}
            m = region.mem
            row["kernel_put_us"] = C.median(sync_timed(lambda: ix.copy_in(m, plan, sa), r))
            row["kernel_get_us"] = C.median(sync_timed(lambda: ix.copy_out(m, plan, da), r))
            for t in thread_counts:
                row[f"put_t{t}_us"] = C.median(await timed(
                    lambda: copier.copy_in(plan, sa, s, threads=t), r))
                row[f"get_t{t}_us"] = C.median(await timed(
                    lambda: copier.copy_out(plan, da, s, threads=t), r))
                if not torch.equal(dst[:s], src[:s]):
                    raise RuntimeError(f"copypath: {s} bytes on {t} threads read back wrong")
                if t > 1:
                    dst[:s].zero_()
                    row[f"put_g{t}_us"] = C.median(await timed(
                        lambda: ganged.copy_in(plan, sa, s, threads=t), r))
                    row[f"get_g{t}_us"] = C.median(await timed(
                        lambda: ganged.copy_out(plan, da, s, threads=t), r))
                    if not torch.equal(dst[:s], src[:s]):
                        raise RuntimeError(f"copypath: {s} bytes on a gang of {t} read back wrong")
            pol = cpucopy.threads_for(s, auto)
            row["policy_threads"] = pol
            row["put_policy_us"] = C.median(await timed(lambda: ganged.copy_in(plan, sa, s), r))
            row["get_policy_us"] = C.median(await timed(lambda: ganged.copy_out(plan, da, s), r))
            for k in [k for k in row if k.endswith("_us") and k != "torch_us"]:
                row[k.replace("_us", "_GBps")] = s / row[k] / 1e3
            row["torch_GBps"] = s / row["torch_us"] / 1e3
            rows.append(row)
            print(f"  {C.human_bytes(s)}: done", flush=True)
        copier.shutdown()
        ganged.shutdown()
        return {"rows": rows, "hop_us_p50": C.median(hop), "hop_us_p99": C.pct(hop, 99),
                "auto_copy_threads": auto, "thread_counts": thread_counts,
                "plan": f"rows of {ROW} B, {STRIDE} B apart in the region"}
    finally:
        region.close()
        if os.path.exists(path):
            os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--max-threads", type=int, default=16)
    a = ap.parse_args()
    sizes = [1 * MiB, 4 * MiB, 16 * MiB] if a.quick else [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB,
                                                           16 * MiB, 32 * MiB, 64 * MiB]
    threads = [t for t in (1, 2, 4, 8, 16) if t <= max(1, a.max_threads)]
    print(f"copy path: cores {os.cpu_count()}, auto copy threads "
          f"{cpucopy.auto_copy_threads()}, thread counts {threads}", flush=True)
    res = tract.run(run(sizes, threads, 5 if a.quick else 20))
    rows = res["rows"]
    cols = ["size", "torch_GBps", "kernel_put_GBps"] + [f"put_t{t}_GBps" for t in threads] + [
        f"put_g{t}_GBps" for t in threads if t > 1] + ["policy_threads", "put_policy_GBps"]
    print("\nput (private -> region, non-temporal), GB/s (medians; kernel = on the caller's "
          "thread, tN = N pool threads, gN = a gang of N, policy = threads_for on the gang)")
    print(C.table(rows, cols))
    cols = ["size", "torch_GBps", "kernel_get_GBps"] + [f"get_t{t}_GBps" for t in threads] + [
        f"get_g{t}_GBps" for t in threads if t > 1] + ["policy_threads", "get_policy_GBps"]
    print("\nget (region -> private, every line invalidated first), GB/s")
    print(C.table(rows, cols))
    print(f"\nthread hop (an empty call through the copy pool): p50 {res['hop_us_p50']:.1f} us, "
          f"p99 {res['hop_us_p99']:.1f} us")
    print("wrote", C.write_json("copypath", res))


if __name__ == "__main__":
    main()
