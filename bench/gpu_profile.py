"""Where the host time of one large CUDA put / get goes (diagnostic, not a benchmark).

cProfile around ``start_put_kv`` / ``start_get_kv`` (reserve + plan + enqueue: the part that is
not the DMA) of a contiguous Llama-3-8B-geometry transfer, after warm-up; prints the functions
with the most own time and the most cumulative time. Used to decide what to optimize in the
CUDA path; ``bench/gpu_putget.py`` is the measurement.

Usage: ``python bench/gpu_profile.py [--mib 1024] [--block-tokens 8] [--reps 3]``.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import time

import torch

import tract_async as tract


async def main(args: argparse.Namespace) -> None:
    lay = tract.KVLayout(num_layers=32, block_tokens=args.block_tokens, kv_heads=8, head_dim=128,
                         dtype=torch.bfloat16)
    n = args.mib * (1 << 20) // lay.block_bytes
    path = f"/dev/shm/tract-gpuprof-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=(args.mib + 320) << 20, create=True,
                             layout=lay, mode="transfer", namespace="bench-prof")
    try:
        async with tract.Engine.open(cfg) as eng:
            eng.cuda_setup()
            kv = torch.randn(lay.kv_shape(n), device="cuda").to(lay.dtype)
            out = torch.empty_like(kv)
            prof_put, prof_get = cProfile.Profile(), cProfile.Profile()
            for r in range(args.reps + 1):
                keys = eng.block_keys(list(range(r * 7, r * 7 + n * lay.block_tokens)),
                                      extra_keys=["prof"])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if r:
                    prof_put.enable()
                fut = await eng.start_put_kv(keys, kv)
                prof_put.disable()
                t1 = time.perf_counter()
                await fut
                t2 = time.perf_counter()
                if r:
                    prof_get.enable()
                fut = await eng.start_get_kv(keys, out=out)
                prof_get.disable()
                t3 = time.perf_counter()
                await fut
                t4 = time.perf_counter()
                await eng.get_kv(keys, out=out)                     # consume: frees the blocks
                print(f"rep {r}: start_put {1e3 * (t1 - t0):.2f} ms, put data {1e3 * (t2 - t1):.2f}, "
                      f"start_get {1e3 * (t3 - t2):.2f}, get data {1e3 * (t4 - t3):.2f}", flush=True)
            for name, p in (("start_put_kv", prof_put), ("start_get_kv", prof_get)):
                for key in ("tottime", "cumtime"):
                    s = io.StringIO()
                    pstats.Stats(p, stream=s).sort_stats(key).print_stats(args.top)
                    print(f"==== {name} by {key} ({args.reps} calls) ====")
                    print("\n".join(s.getvalue().splitlines()[6:]), flush=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--block-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=22)
    asyncio.run(main(ap.parse_args()))
