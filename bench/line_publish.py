"""What publishing one layer's bits costs per block, by how the entry's line 1 is written.

A layer put ends by storing the layer words (``layers_lo``/``layers_hi``) of every block's index
entry (``region/index.py``, ``publish_layers_known``): two non-temporal 8-byte stores into one
64-byte line, then one ``sfence``. On the H100 hosts a 213-block layer put's completion spends
~20 µs there (~94 ns a block; session 53, ``bench/results/gpu-20261207-s53``), more than the
rest of it. Hypothesis: a *partial* write-combining line costs a partial-line write at the
memory controller (a read-modify-write where memory has ECC), so two words cost nearly what a
whole line's round trip does, and writing all eight words of line 1 (the producer knows them:
it wrote them at the reservation) costs one full-line streaming write instead.

Floor (written before measuring): 213 full lines are 13.6 KB, ~1-2 µs at streaming-store
bandwidth plus the fence's drain; a partial line's cost is latency-bound, ~100 ns each with a
few in flight. Predicted: ``full_nt`` <= 1/3 of ``two_nt`` on an Intel host; on the 2-core AMD
VM less difference.

Variants, each timed per call over the same scattered slots (a batch publishes the same slots
every layer), median of ``--reps`` calls, and with the line flushed between calls so each call
starts with memory's copy (the state a layer put meets: the lines were last written by NT):

* ``two_nt``    the product's kernel today: 2 NT word stores a line, one sfence
* ``full_nt``   8 NT word stores a line (the whole line 1), one sfence
* ``store_clwb``  2 cached stores + ``clwb`` a line, one sfence (correct on non-coherent memory)
* ``store_flushopt``  2 cached stores + ``clflushopt`` a line, one sfence
* ``cached``    2 cached stores, one sfence: a floor only (not visible to another host on CXL)

Run: ``python bench/line_publish.py [--blocks 32 213 1024] [--reps 400]``.
Writes bench/results/line-publish-<time>-<commit>.json.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys

import numpy as np
from numba import njit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import tract_kernels as K  # noqa: E402
from tract_kernels.intrinsics import monotonic_ns  # noqa: E402

S = K.site("bench.line_publish")
ENTRY = 128          # an index entry: two lines (region/layout.py, INDEX_ENTRY)
LINE1 = 64


@njit(cache=True, nogil=True)
def _drop(m, offs):
    for i in range(offs.shape[0]):
        K.flush(m, offs[i], S)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def _two_nt(m, offs, v):
    t0 = monotonic_ns()
    for i in range(offs.shape[0]):
        K.store_nt(m, offs[i], v)
        K.store_nt(m, offs[i] + 8, v)
    K.store_fence(m)
    return monotonic_ns() - t0


@njit(cache=True, nogil=True)
def _full_nt(m, offs, v):
    t0 = monotonic_ns()
    for i in range(offs.shape[0]):
        o = offs[i]
        K.store_nt(m, o, v)
        K.store_nt(m, o + 8, v)
        K.store_nt(m, o + 16, v + np.uint64(1))
        K.store_nt(m, o + 24, v + np.uint64(2))
        K.store_nt(m, o + 32, v + np.uint64(3))
        K.store_nt(m, o + 40, v + np.uint64(4))
        K.store_nt(m, o + 48, v + np.uint64(5))
        K.store_nt(m, o + 56, v + np.uint64(6))
    K.store_fence(m)
    return monotonic_ns() - t0


@njit(cache=True, nogil=True)
def _store_clwb(m, offs, v):
    t0 = monotonic_ns()
    for i in range(offs.shape[0]):
        K.store(m, offs[i], v)
        K.store(m, offs[i] + 8, v)
        K.writeback(m, offs[i], S)
    K.store_fence(m)
    return monotonic_ns() - t0


@njit(cache=True, nogil=True)
def _store_flushopt(m, offs, v):
    t0 = monotonic_ns()
    for i in range(offs.shape[0]):
        K.store(m, offs[i], v)
        K.store(m, offs[i] + 8, v)
        K.flush(m, offs[i], S)
    K.store_fence(m)
    return monotonic_ns() - t0


@njit(cache=True, nogil=True)
def _cached(m, offs, v):
    t0 = monotonic_ns()
    for i in range(offs.shape[0]):
        K.store(m, offs[i], v)
        K.store(m, offs[i] + 8, v)
    K.store_fence(m)
    return monotonic_ns() - t0


VARIANTS = {"two_nt": _two_nt, "full_nt": _full_nt, "store_clwb": _store_clwb,
            "store_flushopt": _store_flushopt, "cached": _cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 213, 1024])
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--entries", type=int, default=1 << 16, help="index entries the slots scatter over")
    args = ap.parse_args()
    nbytes = args.entries * ENTRY
    path = f"/dev/shm/tract-bench-line-publish-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    rows: list[dict[str, object]] = []
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        buf = np.frombuffer(mm, dtype=np.uint8)
        buf[:] = 0
        m = K.make_mem(buf, "hw")
        rng = np.random.default_rng(0)
        for n in args.blocks:
            slots = np.sort(rng.choice(args.entries, size=n, replace=False))
            offs = (slots * ENTRY + LINE1).astype(np.int64)
            times: dict[str, list[int]] = {k: [] for k in VARIANTS}
            for fn in VARIANTS.values():          # compile and warm
                _drop(m, offs)
                fn(m, offs, np.uint64(1))
            for r in range(args.reps):            # interleaved: the same minute for each
                for name, fn in VARIANTS.items():
                    _drop(m, offs)
                    times[name].append(fn(m, offs, np.uint64(r + 2)))
            base = C.median(times["two_nt"])
            for name, ts in times.items():
                med = C.median(ts)
                rows.append({"blocks": n, "variant": name, "median_us": med / 1e3,
                             "p90_us": C.pct(ts, 90) / 1e3, "ns_per_block": med / n,
                             "vs_two_nt": med / base})
        del m, buf
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    print(C.table(rows, ["blocks", "variant", "median_us", "p90_us", "ns_per_block", "vs_two_nt"]))
    out = C.write_json("line-publish", {"rows": rows, "reps": args.reps, "entries": args.entries,
                                        "notes": "hw backend over /dev/shm; lines flushed before "
                                                 "each call; variants interleaved; medians"})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
