"""GPU <-> region put/get bandwidth against raw pinned cudaMemcpyAsync, paged gathers, and the
cost of StreamFutures. One run on a CUDA machine; writes bench/results/gpu_putget-<time>-<commit>.json.

Sections (each writes the JSON as it finishes, so a timeout keeps what was measured):

1. contiguous: put_kv / get_kv of 1 MiB .. 1 GiB of Llama-3-8B KV (32 layers, 8 KV heads x 128,
   bf16; 8-token blocks = 1 MiB each) vs ``cudaMemcpyAsync`` between one device buffer and one
   pinned host buffer of the same size (the ceiling: ~55 GB/s each way on the H200). ``e2e`` is
   the whole call (reservation under the global lock included); ``data`` is from the return of
   ``start_put_kv``/``start_get_kv`` (reserved and enqueued) to the published / validated result.
2. paged: one layer of N pool blocks (64 KiB each = Llama-3-8B, 16 tokens), N = 32 .. 2048,
   random block ids, per copy method, vs the contiguous per-layer put of the same bytes, the raw
   copy of the same bytes, and the naive per-block cudaMemcpyAsync.
3. futures: completion latency (await vs cudaEventSynchronize on the same kernel) and CPU time
   per future with many outstanding.

Blocks are freed between repetitions by running in transfer-only mode and consuming them with an
untimed get, so no timed call pays for evictions.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import human_bytes, median, table, write_json  # noqa: E402

import tract_async as tract  # noqa: E402

RESULTS: dict = {"sections": {}}
DEADLINE = [float("inf")]


def over_budget() -> bool:
    return time.monotonic() > DEADLINE[0]


def raw_copy_gbs(nbytes: int, reps: int) -> tuple[float, float]:
    """Median GB/s of one cudaMemcpyAsync D2H and H2D between a device and a pinned buffer
    (host wall time around copy + stream sync, as the engine is timed)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream()
    out = []
    for direction in ("d2h", "h2d"):
        ts = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(s):
                if direction == "d2h":
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
            s.synchronize()
            ts.append(time.perf_counter() - t0)
        out.append(nbytes / median(ts[1:]) / 1e9)
    del dev, host
    return out[0], out[1]


def per_block_copy_gbs(pool: torch.Tensor, ids: np.ndarray, reps: int) -> float:
    """The naive way: one cudaMemcpyAsync per 64 KiB block (K and V adjacent in nb2 order are
    not: this copies each (2, T, H, D) slice of a (2, NB, ...) pool as two halves)."""
    half = pool[0, 0].numel() * pool.element_size()
    host = torch.empty(len(ids) * 2 * half, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream()
    ts = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            for j, b in enumerate(ids.tolist()):
                for h in range(2):
                    k = 2 * j + h
                    host[k * half:(k + 1) * half].copy_(pool[h, b].reshape(-1).view(torch.uint8),
                                                        non_blocking=True)
        s.synchronize()
        ts.append(time.perf_counter() - t0)
    return host.numel() / median(ts[1:]) / 1e9


async def contiguous(args: argparse.Namespace, path: str) -> None:
    lay = tract.KVLayout(num_layers=32, block_tokens=8, kv_heads=8, head_dim=128,
                         dtype=torch.bfloat16)                         # 1 MiB blocks
    sizes_mib = [1, 4, 16, 64, 256, 1024] if not args.quick else [1, 16]
    cfg = tract.EngineConfig(region=path, region_bytes=(max(sizes_mib) + 320) << 20, create=True,
                             layout=lay, mode="transfer", namespace="bench-contig")
    rows = []
    async with tract.Engine.open(cfg) as eng:
        t0 = time.perf_counter()
        cp = eng.cuda_setup()
        RESULTS["registration"] = {**cp.reg.describe(), "uva": cp.reg.device_pointer_matches(),
                                   "elapsed_s": time.perf_counter() - t0}
        for mib in sizes_mib:
            if over_budget():
                break
            n = mib * (1 << 20) // lay.block_bytes
            reps = args.reps if mib <= 256 else max(2, args.reps // 2)
            kv = torch.randn(lay.kv_shape(n), device="cuda").to(lay.dtype)
            out = torch.empty_like(kv)
            raw_d2h, raw_h2d = raw_copy_gbs(n * lay.block_bytes, reps)
            for method in args.methods:
                put_e2e, put_data, get_e2e, get_data = [], [], [], []
                for r in range(reps + 1):
                    keys = eng.block_keys(list(range(r * 7 + mib, r * 7 + mib + n * 8)),
                                          extra_keys=[method])
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fut = await eng.start_put_kv(keys, kv, method=method)
                    t1 = time.perf_counter()
                    assert await fut == n
                    t2 = time.perf_counter()
                    fut = await eng.start_get_kv(keys, out=out, method=method)
                    t3 = time.perf_counter()
                    await fut
                    t4 = time.perf_counter()
                    if r == 0 and mib <= 64:
                        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
                    await eng.get_kv(keys, out=out)                  # consume: frees the blocks
                    if r:
                        put_e2e.append(t2 - t0)
                        put_data.append(t2 - t1)
                        get_e2e.append(t4 - t2)
                        get_data.append(t4 - t3)
                nb = n * lay.block_bytes
                row = {"size": human_bytes(nb), "bytes": nb, "method": method,
                       "raw_d2h_gbs": raw_d2h, "raw_h2d_gbs": raw_h2d,
                       "put_gbs": nb / median(put_e2e) / 1e9, "put_data_gbs": nb / median(put_data) / 1e9,
                       "get_gbs": nb / median(get_e2e) / 1e9, "get_data_gbs": nb / median(get_data) / 1e9}
                row["put_vs_raw"] = row["put_gbs"] / raw_d2h
                row["get_vs_raw"] = row["get_gbs"] / raw_h2d
                rows.append(row)
                print(f"contiguous {row['size']:>8} {method:>8}: put {row['put_gbs']:.1f} GB/s "
                      f"({row['put_vs_raw']:.2f}x raw {raw_d2h:.1f}), get {row['get_gbs']:.1f} "
                      f"({row['get_vs_raw']:.2f}x raw {raw_h2d:.1f})", flush=True)
            RESULTS["sections"]["contiguous"] = rows
            write_json(args.name, RESULTS)
            del kv, out
        RESULTS["engine_cuda_stats"] = eng.stats()["cuda"]
    print(table(rows, ["size", "method", "raw_d2h_gbs", "put_gbs", "put_data_gbs", "put_vs_raw",
                       "raw_h2d_gbs", "get_gbs", "get_data_gbs", "get_vs_raw"]), flush=True)


async def paged(args: argparse.Namespace, path: str) -> None:
    lay = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=8, head_dim=128,
                         dtype=torch.bfloat16)       # 64 KiB per layer-block (Llama-3-8B)
    counts = [32, 64, 128, 256, 512, 1024, 2048] if not args.quick else [32, 256]
    pool_blocks = 4096
    cfg = tract.EngineConfig(region=path, region_bytes=(2 * max(counts) * lay.block_bytes)
                             + (256 << 20), create=True, layout=lay, mode="transfer",
                             namespace="bench-paged")
    rng = np.random.default_rng(0)
    rows = []
    async with tract.Engine.open(cfg) as eng:
        eng.cuda_setup()
        pool = [torch.randn((2, pool_blocks, 16, 8, 128), device="cuda").to(lay.dtype)
                for _ in range(lay.num_layers)]
        back = [torch.zeros_like(p) for p in pool]
        for n in counts:
            if over_budget():
                break
            ids = rng.permutation(pool_blocks)[:n]
            ids2 = rng.permutation(pool_blocks)[:n]
            nbytes = n * lay.layer_bytes
            reps = args.reps
            raw_d2h, raw_h2d = raw_copy_gbs(nbytes, reps)
            naive = per_block_copy_gbs(pool[0], ids, max(2, reps // 2))
            # contiguous per-layer put of the same bytes
            kv_layer = torch.randn(lay.kv_shape(n, 0), device="cuda").to(lay.dtype)
            kv_rest = torch.randn(lay.kv_shape(n, 1), device="cuda").to(lay.dtype)
            cput, cget = [], []
            for r in range(reps + 1):
                keys = eng.block_keys(list(range(r * 13 + n, r * 13 + n + n * 16)),
                                      extra_keys=["contig"])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await eng.put_kv(keys, kv_layer, layer=0)
                t1 = time.perf_counter()
                await eng.put_kv(keys, kv_rest, layer=1)
                out = torch.empty_like(kv_layer)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                fut = await eng.start_get_kv(keys, layer=0, out=out)
                await fut
                t3 = time.perf_counter()
                await eng.get_kv(keys, device="cuda")                 # consume
                if r:
                    cput.append(t1 - t0)
                    cget.append(t3 - t2)
            contig_put, contig_get = nbytes / median(cput) / 1e9, nbytes / median(cget) / 1e9
            for method in args.methods:
                pput, pget = [], []
                for r in range(reps + 1):
                    keys = eng.block_keys(list(range(r * 13 + n, r * 13 + n + n * 16)),
                                          extra_keys=["paged", method])
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    await eng.put_kv_paged(keys, pool, ids, layer=0, method=method)
                    t1 = time.perf_counter()
                    await eng.put_kv_paged(keys, pool, ids, layer=1)
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    fut = await eng.start_get_kv_paged(keys, back, ids2, layer=0, method=method)
                    await fut
                    t3 = time.perf_counter()
                    if r == 0:
                        sel, sel2 = (torch.as_tensor(x, device="cuda") for x in (ids, ids2))
                        assert torch.equal(back[0][:, sel2].view(torch.int16),
                                           pool[0][:, sel].view(torch.int16)), "paged mismatch"
                    await eng.get_kv_paged(keys, back, ids2)               # consume
                    if r:
                        pput.append(t1 - t0)
                        pget.append(t3 - t2)
                row = {"blocks": n, "bytes": nbytes, "method": method, "raw_d2h_gbs": raw_d2h,
                       "raw_h2d_gbs": raw_h2d, "naive_per_block_d2h_gbs": naive,
                       "contig_put_gbs": contig_put, "contig_get_gbs": contig_get,
                       "paged_put_gbs": nbytes / median(pput) / 1e9,
                       "paged_get_gbs": nbytes / median(pget) / 1e9}
                row["put_vs_contig"] = row["paged_put_gbs"] / contig_put
                row["get_vs_contig"] = row["paged_get_gbs"] / contig_get
                rows.append(row)
                print(f"paged {n:>5} x 64 KiB {method:>8}: put {row['paged_put_gbs']:.1f} GB/s "
                      f"({row['put_vs_contig']:.2f}x contig {contig_put:.1f}), get "
                      f"{row['paged_get_gbs']:.1f} ({row['get_vs_contig']:.2f}x contig "
                      f"{contig_get:.1f}); naive {naive:.1f}, raw {raw_d2h:.1f}", flush=True)
            RESULTS["sections"]["paged"] = rows
            write_json(args.name, RESULTS)
        RESULTS["engine_cuda_stats_paged"] = eng.stats()["cuda"]
    print(table(rows, ["blocks", "method", "naive_per_block_d2h_gbs", "contig_put_gbs",
                       "paged_put_gbs", "put_vs_contig", "contig_get_gbs", "paged_get_gbs",
                       "get_vs_contig"]), flush=True)


async def futures(args: argparse.Namespace) -> None:
    from tract_async.cuda.futures import StreamFuture, poller
    s = torch.cuda.Stream()
    cycles = 2_000_000                                   # ~1 ms of GPU time on an H200
    # latency: the same short kernel, waited by event.synchronize() and by awaiting a future
    sync_t, await_t = [], []
    for i in range(args.future_reps):
        for mode in ("sync", "await"):
            torch.cuda.synchronize()
            with torch.cuda.stream(s):
                torch.cuda._sleep(cycles)
                ev = torch.cuda.Event()
                ev.record(s)
            t0 = time.perf_counter()
            if mode == "sync":
                ev.synchronize()
                sync_t.append(time.perf_counter() - t0)
            else:
                await StreamFuture(ev)
                await_t.append(time.perf_counter() - t0)
    lat = {"kernel_sync_us_p50": median(sync_t) * 1e6, "kernel_await_us_p50": median(await_t) * 1e6,
           "added_latency_us_p50": (median(await_t) - median(sync_t)) * 1e6,
           "added_latency_us_p90": (sorted(await_t)[int(0.9 * len(await_t))] -
                                    sorted(sync_t)[int(0.9 * len(sync_t))]) * 1e6}
    # CPU cost: many outstanding futures over a stream of 1 ms kernels
    n = args.future_count
    p = poller()
    w0, q0 = p.wakeups, p.queries
    torch.cuda.synchronize()
    futs = []
    with torch.cuda.stream(s):
        for _ in range(n):
            torch.cuda._sleep(cycles // 4)
            ev = torch.cuda.Event()
            ev.record(s)
            futs.append(ev)
    c0, t0 = time.process_time(), time.perf_counter()
    sf = [StreamFuture(e) for e in futs]
    await asyncio.gather(*sf)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    cost = {"futures": n, "wall_s": wall, "cpu_s": cpu, "cpu_us_per_future": cpu / n * 1e6,
            "cpu_fraction_of_one_core": cpu / wall, "poller_wakeups": p.wakeups - w0,
            "poller_queries": p.queries - q0}
    # idle cost: one future pending on a 50 ms kernel
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles * 50)
        ev = torch.cuda.Event()
        ev.record(s)
    c0, t0 = time.process_time(), time.perf_counter()
    await StreamFuture(ev)
    idle = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    idle["cpu_fraction_of_one_core"] = idle["cpu_s"] / idle["wall_s"]
    RESULTS["sections"]["futures"] = {"latency": lat, "cost": cost, "one_pending_50ms": idle}
    write_json(args.name, RESULTS)
    print(f"futures: latency +{lat['added_latency_us_p50']:.1f} us p50 over cudaEventSynchronize "
          f"({lat['kernel_sync_us_p50']:.0f} vs {lat['kernel_await_us_p50']:.0f} us); "
          f"{cost['cpu_us_per_future']:.1f} us CPU per future ({n} outstanding, "
          f"{cost['cpu_fraction_of_one_core']:.2f} of a core); one pending 50 ms future: "
          f"{idle['cpu_fraction_of_one_core']:.3f} of a core", flush=True)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=["auto", "dma", "dma2d", "zerocopy"])
    ap.add_argument("--future-reps", type=int, default=200)
    ap.add_argument("--future-count", type=int, default=2000)
    ap.add_argument("--budget-s", type=float, default=100.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--name", default="gpu_putget")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_putget: no CUDA device; nothing to measure")
        return 0
    DEADLINE[0] = time.monotonic() + args.budget_s
    RESULTS["args"] = vars(args)
    RESULTS["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton
        RESULTS["triton"] = triton.__version__
    except Exception as e:
        RESULTS["triton"] = f"unavailable: {e}"
    base = f"/dev/shm/tract-bench-gpu-{os.getpid()}"
    try:
        await futures(args)
        await contiguous(args, base + "-c")
        await paged(args, base + "-p")
    finally:
        for suffix in ("-c", "-p"):
            try:
                os.unlink(base + suffix)
            except FileNotFoundError:
                pass
        print("wrote", write_json(args.name, RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
