"""One layer of N blocks between device memory and registered host memory: 2-D copies against one
batch of 1-D copies (``cudaMemcpyBatchAsync``) and against the zero-copy row kernel
(``cuda/triton_copy.py``), with blocks evenly spaced or scattered.

    python bench/copy_batch.py [--blocks 32 213 1024] [--reps 30]

Why: the direct path (``tract_async/cuda/direct.py``) moves a contiguous layer tensor with two
2-D copies when its blocks sit evenly spaced in the region, but with ``2 x runs`` driver calls
(~2 µs of host time each) when they are scattered: 500 µs of host time for a 213-block layer on
the H100 host (``bench/results/gpu-20261207-s45``). This measures, without the engine, what each
way costs: the host time of the enqueue (``issue``), the device time between two events around
it, and the whole (enqueue to event synchronized), against the raw ceiling: one
``cudaMemcpyAsync`` of the same bytes between one device buffer and one pinned buffer.

Geometry: Llama-3-8B (64 KiB per block and layer, K and V halves of 32 KiB, 2 MiB slots: a
layer's K rows every 2 MiB in the region). ``scattered``: the blocks take random slots among
``2 x N``. Every way is checked byte for byte once per case before it is timed. Writes
``bench/results/copy-batch-<time>-<commit>.json``.

``zerocopy``: one launch of the row kernel, the device's SMs loading from (a get) or storing to
(a put) the mapped region over the link, one row per block and plane; its host time includes
the upload of the row table (pinned, on the stream), as the engine's zero-copy path does.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from typing import Any, Callable

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import _common as C  # noqa: E402
C.leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import torch  # noqa: E402

from tract_async.cuda import direct, events  # noqa: E402
from tract_async.cuda.hostreg import HostRegistration  # noqa: E402


def timed(fn: Callable[[], Any], stream: Any, reps: int) -> dict[str, float]:
    """Median host µs of ``fn`` (the enqueue), device µs between events around it, and µs from
    the enqueue's start to the end event synchronized."""
    host, dev, e2e = [], [], []
    for _ in range(reps + 2):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        stream.synchronize()
        a.record(stream)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record(stream)
        b.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        dev.append(a.elapsed_time(b) * 1e3)
        e2e.append((t2 - t0) * 1e6)
    host, dev, e2e = host[2:], dev[2:], e2e[2:]
    return {"host_us": C.median(host), "device_us": C.median(dev), "e2e_us": C.median(e2e),
            "e2e_p90_us": C.pct(e2e, 0.9)}


def exact_once(fn: Callable[[], Any], matches: Callable[[], bool], dbuf: Any, to_region: bool,
               stream: Any) -> bool:
    """Run ``fn`` once and check its bytes: after a put the region's rows equal the tensor's;
    after a get into a zeroed tensor, the tensor equals the region's rows. The tensor is
    restored afterwards."""
    saved = dbuf.clone()
    if not to_region:
        dbuf.zero_()
    torch.cuda.synchronize(dbuf.device)
    fn()
    stream.synchronize()
    ok = matches()
    dbuf.copy_(saved)
    torch.cuda.synchronize(dbuf.device)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 213, 1024])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layer", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("copy_batch: needs CUDA")
    lay = C.llama_layout()
    half, slot = lay.half_layer_bytes, lay.block_bytes
    nmax = max(args.blocks)
    nslots = 2 * nmax
    dev = torch.device("cuda", 0)
    # an anonymous shared mapping, registered as the engine registers its region
    mm = mmap.mmap(-1, nslots * slot)
    region = np.frombuffer(mm, dtype=np.uint8)
    region.view(np.int64)[:] = np.arange(region.size // 8, dtype=np.int64)  # every word unique
    reg = HostRegistration(region)
    if not reg.registered:
        sys.exit(f"copy_batch: the buffer could not be registered: {reg.describe()}")
    fc = events.fast_calls()
    from tract_async.cuda import triton_copy
    have_zc = triton_copy.available()[0]
    region_i32 = reg.tensor.view(torch.int32) if have_zc else None
    stream = torch.cuda.Stream(dev)
    handle = int(stream.cuda_stream)
    why = direct.batch_probe(fc, dev, stream)
    pinned = torch.empty(nmax * 2 * half, dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"machine": C.machine(), "layout": "llama3-8b 64 KiB/block/layer",
                           "layer": args.layer, "reps": args.reps, "batch_unavailable": why,
                           "cases": rows}
    for n in args.blocks:
        nbytes = n * 2 * half
        dbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dbuf.view(torch.int64).random_()
        for kind in ("evenly", "scattered"):
            slots = (np.arange(n) if kind == "evenly"
                     else rng.choice(nslots, size=n, replace=False))
            poffs = (slots * slot).astype(np.int64)
            plans = {"2d": direct.plan(lay, poffs, args.layer, dbuf.data_ptr(), reg.ptr)}
            if why is None:
                plans["batch"] = direct.plan(lay, poffs, args.layer, dbuf.data_ptr(), reg.ptr,
                                             batch="all")
            # the zero-copy rows: (source, destination) offsets in 16-byte units from the
            # anchors (the device buffer, the region), block-major, K then V
            dev_off = (np.arange(2)[None, :] * (n * half) + np.arange(n)[:, None] * half)
            reg_off = (poffs[:, None] + args.layer * lay.layer_bytes
                       + np.arange(2)[None, :] * half)
            zc_rows = np.stack([dev_off.reshape(-1), reg_off.reshape(-1)], axis=1) // 16
            for direction in ("put", "get"):
                to_region = direction == "put"
                raw_dst, raw_src = (pinned[:nbytes], dbuf) if to_region else (dbuf, pinned[:nbytes])

                def raw() -> None:
                    with torch.cuda.stream(stream):
                        raw_dst.copy_(raw_src, non_blocking=True)
                raw_r = timed(raw, stream, args.reps)
                rows.append({"blocks": n, "slots": kind, "op": direction, "way": "raw",
                             "calls": 1, **raw_r, "ratio_vs_raw": 1.0})
                if have_zc:
                    tbl = np.ascontiguousarray(zc_rows if to_region else zc_rows[:, ::-1])
                    tpin = torch.from_numpy(tbl).pin_memory()
                    anchors = ((dbuf.view(torch.int32), region_i32) if to_region
                               else (region_i32, dbuf.view(torch.int32)))

                    def zc() -> None:
                        with torch.cuda.stream(stream):
                            tdev = tpin.to(dev, non_blocking=True)
                            triton_copy.copy_rows(anchors[0], anchors[1], tdev, half)
                    ok = exact_once(zc, lambda: _matches_rows(zc_rows, half, dbuf, region),
                                    dbuf, to_region, stream)
                    r = timed(zc, stream, args.reps)
                    rows.append({"blocks": n, "slots": kind, "op": direction, "way": "zerocopy",
                                 "calls": 2, "exact": ok, **r,
                                 "ratio_vs_raw": raw_r["e2e_us"] / r["e2e_us"]})
                for way, dc in plans.items():
                    if dc is None:
                        rows.append({"blocks": n, "slots": kind, "op": direction, "way": way,
                                     "calls": None, "note": "gather path (too many calls)"})
                        continue

                    def go(dc: Any = dc) -> None:
                        direct.issue(dc, handle, to_region=to_region, fc=fc)
                    ok = exact_once(go, lambda dc=dc: _matches_region(dc, dbuf, region, reg),
                                    dbuf, to_region, stream)
                    r = timed(go, stream, args.reps)
                    rows.append({"blocks": n, "slots": kind, "op": direction, "way": way,
                                 "calls": len(dc), "exact": ok, **r,
                                 "ratio_vs_raw": raw_r["e2e_us"] / r["e2e_us"]})
    print(C.table(rows, ["blocks", "slots", "op", "way", "calls", "exact", "host_us",
                         "device_us", "e2e_us", "e2e_p90_us", "ratio_vs_raw"]))
    if why is not None:
        print(f"batched copies unavailable: {why}")
    print("wrote", C.write_json("copy-batch", out))
    reg.close()


def _matches_rows(zc_rows: np.ndarray, width: int, dbuf: Any, region: Any) -> bool:
    """The tensor's bytes equal the region's at the zero-copy rows (16-byte units)."""
    host = dbuf.cpu().numpy()
    for t, r in (zc_rows * 16).tolist():
        if not np.array_equal(region[r:r + width], host[t:t + width]):
            return False
    return True


def _matches_region(dc: Any, dbuf: Any, region: Any, reg: Any) -> bool:
    """The tensor's bytes equal the region rows ``dc`` names (read on the host)."""
    host = dbuf.cpu().numpy()
    rows = dc.rows
    base = dbuf.data_ptr()
    r8 = region
    for r, rp, t, tp, w, h in rows.tolist():
        for k in range(h):
            ro = r - reg.ptr + k * rp
            to = t - base + k * tp
            if not np.array_equal(r8[ro:ro + w], host[to:to + w]):
                return False
    return True


if __name__ == "__main__":
    main()
