"""Kernel costs: ns per store+flush+fence and per invalidate+load; GB/s of the non-temporal
payload write and the invalidate+copy read against torch ``copy_`` and ``np.copyto``.

Floor (written before measuring): one flushed store costs a write-back to DRAM, about the
~300 ns DRAM latency of this VM plus the fence (the spike measured 556-725 ns); a clean
invalidate+load costs one DRAM miss (360-430 ns). For copies the floor is memory bandwidth
(~9 GB/s for large copies here); the NT write should beat copy+flush for cache-resident sizes
(1-16 MiB) by skipping the read-for-ownership and the flush, and match memcpy at 256 MiB.

Run: ``python bench/kernels.py [--quick]``. Writes bench/results/kernels-<time>-<commit>.json.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import numpy as np
import torch
from numba import njit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import tract_kernels as K  # noqa: E402
from tract_kernels.intrinsics import monotonic_ns  # noqa: E402

S = K.site("bench.kernels")


@njit(cache=True, nogil=True)
def _store_flush_loop(m, iters):
    t0 = monotonic_ns()
    for i in range(iters):
        K.store_flush(m, 64, i, S)
    return (monotonic_ns() - t0) / iters


@njit(cache=True, nogil=True)
def _inval_load_loop(m, iters):
    t0 = monotonic_ns()
    acc = np.uint64(0)
    for _ in range(iters):
        acc += K.load_fresh(m, 128, S)
    return (monotonic_ns() - t0) / iters + 0.0 * acc


@njit(cache=True, nogil=True)
def _store_loop(m, iters):
    t0 = monotonic_ns()
    for i in range(iters):
        K.store(m, 192, i)
        K.full_fence(m)
    return (monotonic_ns() - t0) / iters


def _gbps(fn, nbytes: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / C.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    args = ap.parse_args()
    path = f"/dev/shm/tract-bench-kernels-{os.getpid()}"
    sizes = [64 << 10, 1 << 20, 16 << 20, 256 << 20] if not args.quick else [64 << 10, 1 << 20, 16 << 20]
    region_bytes = max(sizes) + (1 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, region_bytes)
        mm = mmap.mmap(fd, region_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        buf = np.frombuffer(mm, dtype=np.uint8)
        buf[:] = 1  # fault every page in before timing
        m = K.make_mem(buf, "hw")
        iters = 20_000 if args.quick else 200_000
        word = []
        for name, fn in (("store+flush+mfence", _store_flush_loop), ("invalidate+mfence+load", _inval_load_loop),
                         ("store+mfence (no flush)", _store_loop)):
            fn(m, 100)
            ns = C.median([fn(m, iters) for _ in range(5)])
            word.append({"op": name, "ns": ns})
        print("word operations (hw backend, /dev/shm), median of 5 x", iters)
        print(C.table(word, ["op", "ns"]))

        shm_t = torch.frombuffer(mm, dtype=torch.uint8)
        rows = []
        for nb in sizes:
            reps = 5 if nb >= 64 << 20 else (20 if nb >= 1 << 20 else 200)
            src = torch.randint(0, 255, (nb,), dtype=torch.uint8)
            dst = torch.empty(nb, dtype=torch.uint8)
            src_np, dst_np = src.numpy(), dst.numpy()
            view = shm_t[:nb]
            view_np = buf[:nb]
            r = {"size": C.human_bytes(nb)}
            r["nt_write"] = _gbps(lambda: K.write_bytes(m, 0, src.data_ptr(), nb, S), nb, reps)
            r["torch_write"] = _gbps(lambda: view.copy_(src), nb, reps)
            r["np_write"] = _gbps(lambda: np.copyto(view_np, src_np), nb, reps)
            r["copy+flush_write"] = _gbps(lambda: (view.copy_(src), K.flush_range(m, 0, nb, S)), nb, reps)
            r["inval+read"] = _gbps(lambda: K.read_bytes(m, 0, dst.data_ptr(), nb, S), nb, reps)
            r["torch_read"] = _gbps(lambda: dst.copy_(view), nb, reps)
            r["np_read"] = _gbps(lambda: np.copyto(dst_np, view_np), nb, reps)
            r["nt/torch_write"] = r["nt_write"] / r["torch_write"]
            r["read/torch_read"] = r["inval+read"] / r["torch_read"]
            rows.append(r)
            assert torch.equal(dst, src)
        cols = ["size", "nt_write", "torch_write", "np_write", "copy+flush_write", "inval+read",
                "torch_read", "np_read", "nt/torch_write", "read/torch_read"]
        print("\npayload copies, GB/s (median)")
        print(C.table(rows, cols))
        out = C.write_json("kernels", {"word_ops_ns": word, "copies_gbps": rows,
                                       "notes": "hw backend over a /dev/shm mapping; medians"})
        print(f"\nwrote {out}")
        del view, view_np, shm_t, buf, m
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
