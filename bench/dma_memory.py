"""What host memory costs a DMA: the same copies into pinned memory of several kinds.

    python bench/dma_memory.py                 # a GPU host; ~30 s
    python bench/dma_memory.py --mib 426 --reps 10

Issue 35's whole-prompt figures compare the engine against a raw copy into memory from
``cudaHostAlloc`` (``torch.empty(..., pin_memory=True)``), while the engine's region is a file
in ``/dev/shm`` registered with ``cudaHostRegister``. A whole prompt's DMA, measured alone
(``bench/gpu_layers.py`` whole-prompt split), took 9.1-9.5 ms where the raw copy of the same
bytes took 8.1 on the H100 host (``bench/results/gpu-20261207-s49``), with the host's metadata
off the critical path. Before calling that a floor, this measures the raw copies themselves
into each kind of memory -- contiguous ``cudaMemcpyAsync`` both ways, and the whole-prompt
pattern (one 2-D copy per K/V plane: 32 KiB rows, one per block, 2 MiB apart in the host
memory) -- so that the memory and the copy pattern are told apart. ``*_blocks`` moves the same
bytes block by block instead (one 2-D copy per block: its 64 planes strided on the device,
2 MiB contiguous in the host memory; 213 driver calls instead of 64): the planes pattern ran
at 0.96x of the contiguous copy (``bench/results/gpu-20261207-s50``), and whether the host
side's 2-MiB stride or the 32 KiB rows cost that 4 % decides which pattern a whole-block put
should use. Kinds of memory:

* ``hostalloc``: ``cudaHostAlloc`` (the benchmarks' raw baseline);
* ``shm``: a ``/dev/shm`` file, mapped shared and registered (the engine's region);
* ``shm-thp``: the same with ``madvise(MADV_HUGEPAGE)`` before the first touch (honoured
  where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows it);
* ``anon-thp``: anonymous memory with ``MADV_HUGEPAGE``, registered.

Prints a table (median ms and GB/s per kind, direction and pattern) and writes
``bench/results/dma-memory-<time>-<commit>.json`` (``_common.write_json``) with the machine, the THP settings and the kernel's
huge-page counters after each allocation.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import _common as C  # noqa: E402
C.leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tract_async.cuda.hostreg import HostRegistration, memcpy2d_async  # noqa: E402

BLOCK = 2 << 20          # a Llama-3-8B block, all layers
ROW = 32 << 10           # one K or V plane of one block and layer


def _meminfo() -> dict[str, str]:
    out = {}
    for line in C.read_text("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if "Huge" in k or k in ("Shmem", "ShmemPmdMapped"):
            out[k] = v.strip()
    return out


class Buffer:
    """``nbytes`` of host memory of one kind, page-locked for the device, as a uint8 tensor."""

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        self.mm: mmap.mmap | None = None
        self.reg: HostRegistration | None = None
        self.path: str | None = None
        if kind == "hostalloc":
            self.t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return
        if kind.startswith("shm"):
            fd, self.path = tempfile.mkstemp(prefix="tract-dmamem-", dir="/dev/shm")
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
        else:
            self.mm = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        if kind.endswith("thp"):
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(self.mm, dtype=np.uint8)
        arr[::4096] = 1                            # touch every page before pinning
        self.reg = HostRegistration(arr)
        if not self.reg.registered:
            raise RuntimeError(f"{kind}: {self.reg.reason}")
        self.t = self.reg.tensor

    def close(self) -> None:
        self.t = None  # type: ignore[assignment]
        if self.reg is not None:
            self.reg.close()
            self.reg.tensor = None  # type: ignore[assignment]
            self.reg.buf = None  # type: ignore[assignment]
            self.reg = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass                               # a view still alive: freed at exit
        if self.path is not None:
            os.unlink(self.path)


def timed(fn: Any, reps: int) -> float:
    """Median seconds of ``fn()`` then a device sync, after one warm-up."""
    ts = []
    for r in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if r:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(buf: Buffer, dev: torch.Tensor, nbytes: int, reps: int) -> dict[str, float]:
    host = buf.t
    s = torch.cuda.current_stream()
    h = int(s.cuda_stream)
    nblocks = nbytes // BLOCK
    planes = BLOCK // ROW
    hp, dp = host.data_ptr(), dev.data_ptr()

    def planes_copy(to_host: bool) -> None:
        # the whole-prompt pattern: plane p of block j is device row p*n + j (contiguous per
        # plane) and host bytes j*BLOCK + p*ROW
        for p in range(planes):
            d = dp + p * nblocks * ROW
            o = hp + p * ROW
            if to_host:
                memcpy2d_async(o, BLOCK, d, ROW, ROW, nblocks, h)
            else:
                memcpy2d_async(d, ROW, o, BLOCK, ROW, nblocks, h)

    def blocks_copy(to_host: bool) -> None:
        # the same bytes block by block: one 2-D copy per block, its 64 planes strided on the
        # device (pitch n * ROW) and contiguous in the host memory (2 MiB written in order)
        for j in range(nblocks):
            d = dp + j * ROW
            o = hp + j * BLOCK
            if to_host:
                memcpy2d_async(o, ROW, d, nblocks * ROW, ROW, planes, h)
            else:
                memcpy2d_async(d, nblocks * ROW, o, ROW, ROW, planes, h)

    out = {"d2h": timed(lambda: host.copy_(dev, non_blocking=True), reps),
           "h2d": timed(lambda: dev.copy_(host, non_blocking=True), reps),
           "d2h_planes": timed(lambda: planes_copy(True), reps),
           "h2d_planes": timed(lambda: planes_copy(False), reps),
           "d2h_blocks": timed(lambda: blocks_copy(True), reps),
           "h2d_blocks": timed(lambda: blocks_copy(False), reps)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=426, help="bytes per copy (426: a 213-block prompt)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kinds", default="hostalloc,shm,shm-thp,anon-thp")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("dma_memory: needs a CUDA device", file=sys.stderr)
        return 2
    nbytes = (args.mib << 20) // BLOCK * BLOCK
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.random_(0, 255)
    res: dict[str, Any] = {"benchmark": "dma_memory", "issue": 35, "bytes": nbytes, "reps": args.reps,
                           "thp": {"enabled": C.read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
                                   "shmem_enabled": C.read_text(
                                       "/sys/kernel/mm/transparent_hugepage/shmem_enabled")},
                           "kinds": {}}
    rows = []
    for kind in args.kinds.split(","):
        try:
            buf = Buffer(kind, nbytes)
        except Exception as e:
            res["kinds"][kind] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{kind}: {e}", flush=True)
            continue
        try:
            m = measure(buf, dev, nbytes, args.reps)
            res["kinds"][kind] = {"seconds": m, "meminfo": _meminfo()}
            for k, v in m.items():
                rows.append({"kind": kind, "copy": k, "ms": v * 1e3, "gbs": nbytes / v / 1e9})
        finally:
            buf.close()
    base = {r["copy"]: r["ms"] for r in rows if r["kind"] == "hostalloc"}
    for r in rows:
        r["vs_hostalloc"] = (base[r["copy"]] / r["ms"]) if r["copy"] in base else None
    res["rows"] = rows
    print(C.table(rows, ["kind", "copy", "ms", "gbs", "vs_hostalloc"]), flush=True)
    print(f"wrote {C.write_json('dma-memory', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
