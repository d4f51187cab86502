"""Which payload bytes this host's CPUs may hold in their caches: the reason a GPU read of the
region invalidates only some blocks, or none.

Why. On non-coherent shared memory (CXL Type-3 shared between hosts) a line this host cached
stays as it was when another host rewrites the memory behind it. A CPU read drops its lines
first (``read_rows``), and so did every GPU read, one ``clflushopt`` per 64 bytes of every
block it reads: 0.3-0.6 ms of a 213-block layer get on the GPU hosts, on the critical path,
~40 % of the get. But a GPU read is a DMA by the device, which the host's root complex snoops
against this host's caches, so a stale line can only exist where *this host's CPU* read that
memory since the other host's write. The CPU write paths leave no lines: payload is written
with non-temporal stores, which evict any cached copy, and partial edge lines are flushed
(``mem.write_rows``). The hardware prefetchers pull in lines near what the CPU reads, never
across a 4 KiB page (the L2 streamer and the adjacent-line prefetcher work inside a page), so
a record with a granule of whole pages that covers every range the CPU read covers every line
the prefetchers could have brought in too.

So every CPU read of payload marks the granules it read (``mark``, from ``BlockLifecycle.
count_read``: every CPU read path counts there), and a GPU read invalidates only blocks with a
marked granule in the range it reads (``needing``), clearing their marks *before* it
invalidates (``clear``): a CPU read racing with it either cached its lines before the
invalidation (dropped) or marks after the clear (kept). Nothing else clears a mark: a block
freed and reused by another host is exactly the case it exists for.

Scope: the host, not the node. Several processes of one host share its caches, so the record
is a small host-local file beside the region (``sidecar_path``), mapped by every node of the
region on this host: one byte per ``GRANULE_BYTES`` of the region (256 KiB for a 1 GiB region,
256 MiB for 1 TiB: bytes, not bits, because two processes may mark neighbouring pages at once
and a byte store needs no atomic read-modify-write). It lives in ``/dev/shm`` (a local, coherent tmpfs: plain stores suffice)
and is removed with the region (``remove``). A new record starts with every granule marked:
it cannot know what was read before it existed, so each granule's first GPU read on this host
invalidates it once (``_open_or_make``).

A new record's marks would make every block's first GPU read on this host pay for the
invalidation of its layer (13 MiB of ``clflushopt`` for a 213-block layer of Llama-3-8B, on the
read's critical path) until the reads have covered the region once: what a benchmark on a fresh
region, or a decode worker after a restart, measures. A node that reads with a GPU therefore
runs a ``Sweeper`` (started with its CUDA path): one background thread that walks the record
once and, for each marked granule, clears the mark and then invalidates the granule's lines --
the same two steps, in the same order, as a GPU read's own, done ahead of the reads ("ahead of
time, at idle"). A GPU read that comes first still invalidates for itself; the two only repeat
each other's work.

The window this leaves: a CPU read marks right after its copy and validation, so a GPU read on
this host that looks between the two finds no mark; its DMA then reads the same current bytes
the CPU just cached (nothing stale yet). For the cached lines to go stale the block must be
evicted and its payload rewritten by another host, and for the GPU read to miss the mark it
would have to read that new block between the copy and the mark: microseconds, during which the
old block passed validation as live.

Byte layout of the sidecar file (host-local, not on the region):

| bytes | what |
|---|---|
| ``[g, g+1)`` for granule ``g`` | 1: this host's CPU read region bytes ``[g*GRANULE_BYTES, (g+1)*GRANULE_BYTES)`` since a GPU read last invalidated them; 0: it did not |
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np
from numba import njit

import tract_kernels as K

GRANULE_SHIFT = 12
GRANULE_BYTES = 1 << GRANULE_SHIFT
"""One mark covers one 4 KiB page: a prefetcher never leaves its page, and a layer of a block
(64 KiB for Llama-3-8B, at page-aligned payload offsets) is whole pages, so a GPU read of one
layer clears exactly what it invalidated. (A coarser granule straddling two layers could never
be cleared by a layer read: every later read would invalidate again.)"""

SHM_DIR = "/dev/shm"
ENV_DIR = "TRACT_CPUMARKS_DIR"
"""Where the host-local record lives when the region is not itself in ``/dev/shm``."""


def sidecar_path(region_path: str, uuid_hex: str) -> str:
    """The record of the region at ``region_path``: beside it when the region is a file in
    ``/dev/shm`` (so that whatever removes ``path*`` removes it too), else in ``/dev/shm`` named
    by the region's uuid (a DAX device, a hugetlbfs file)."""
    real = os.path.abspath(region_path)
    if os.path.dirname(real) == SHM_DIR:
        return real + ".cpumarks"
    return os.path.join(os.environ.get(ENV_DIR, SHM_DIR), f"tract-cpumarks-{uuid_hex}")


@njit(cache=True)             # µs-scale: holds the GIL (stores/fused.py, "Holding the GIL")
def _mark(marks, poffs, rel, span, shift):
    # a load before each store: a host that keeps reading the same blocks finds them marked,
    # and a store of the same value would still dirty the line (and, with other processes of
    # the host marking too, move it between their cores)
    for i in range(poffs.shape[0]):
        a = (poffs[i] + rel) >> shift
        b = (poffs[i] + rel + span - 1) >> shift
        for g in range(a, b + 1):
            if marks[g] == 0:
                marks[g] = 1


@njit(cache=True)             # µs-scale: holds the GIL (stores/fused.py, "Holding the GIL")
def _needing(marks, marks64, poffs, rel, span, shift, out):
    """``out[:k]``: the entries of ``poffs`` with a marked granule in ``[poff + rel, +span)``;
    returns ``k``. ``marks64``: the same bytes as words, eight granules a look in the middle of
    a range (a whole Llama-3-8B block is 512 granules: its look on the 2-core VM took 137 µs
    for 213 blocks byte by byte)."""
    k = 0
    n64 = marks64.shape[0]
    for i in range(poffs.shape[0]):
        a = (poffs[i] + rel) >> shift
        b = (poffs[i] + rel + span - 1) >> shift          # inclusive
        g = a
        hit = False
        while g <= b and (g & 7) != 0:                      # up to a word boundary
            if marks[g] != 0:
                hit = True
                break
            g += 1
        while not hit and g + 7 <= b and (g >> 3) < n64:    # whole words
            if marks64[g >> 3] != 0:
                hit = True
            g += 8
        while not hit and g <= b:                           # the tail
            if marks[g] != 0:
                hit = True
            g += 1
        if hit:
            out[k] = poffs[i]
            k += 1
    return k


@njit(cache=True)             # µs-scale: holds the GIL (stores/fused.py, "Holding the GIL")
def _clear(marks, poffs, rel, span, shift):
    # only granules wholly inside [start, start + span): a granule that reaches beyond holds
    # bytes this invalidation does not drop
    gb = np.int64(1) << shift
    for i in range(poffs.shape[0]):
        start = poffs[i] + rel
        a = (start + gb - 1) >> shift
        b = (start + span) >> shift
        for g in range(a, b):
            marks[g] = 0


@njit(cache=True, nogil=True)
def _sweep(marks, m, g0, g1, shift, site, scratch):
    """Clear every marked granule of ``[g0, g1)``, fence, then invalidate the lines of those
    granules (``scratch``: room for ``g1 - g0`` indices). Returns how many were marked.

    The fence: ``clflushopt`` is ordered only with older stores to its own line, so without it
    an invalidation could pass the store that clears the mark, and a CPU read on another core
    that cached the line and marked it in between would have its mark erased."""
    k = 0
    for g in range(g0, g1):
        if marks[g] != 0:
            marks[g] = 0
            scratch[k] = g
            k += 1
    if k == 0:
        return 0
    K.full_fence(m)
    size = m[K.MEM_SIZE_BYTES]
    for i in range(k):
        off = scratch[i] << shift
        n = min(np.int64(1) << shift, size - off)
        if n > 0:
            K.invalidate_range(m, off, n, site)
    return k


def _open_or_make(path: str, nbytes: int) -> int:
    """An fd of the record at ``path``, made whole if there is none: every granule marked,
    because a new record knows nothing of what this host's CPUs read before it existed (a
    region overwritten in place on a DAX device keeps its physical memory, and perhaps cached
    lines of it). The first GPU read of each granule then invalidates it once. Made in a
    temporary file and linked into place, so a concurrent opener never sees it half made."""
    for _ in range(8):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            pass
        else:
            if os.fstat(fd).st_size >= nbytes:
                return fd
            os.close(fd)           # a record of another size: an older region at this path
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.pwrite(fd, b"\x01" * nbytes, 0)
            os.link(tmp, path)
            return fd
        except FileExistsError:
            os.close(fd)               # another process made it first: use theirs
        except BaseException:
            os.close(fd)
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    raise OSError(f"cannot open or make the CPU-cache record {path}")


class CpuMarks:
    """The host-local record of one region (see the module docstring)."""

    def __init__(self, path: str, region_bytes: int) -> None:
        self.path = path
        self.nbytes = max(1, (region_bytes + GRANULE_BYTES - 1) >> GRANULE_SHIFT)
        fd = _open_or_make(path, self.nbytes)
        try:
            self._mm: Any = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.marks = np.frombuffer(self._mm, dtype=np.uint8)
        self.marks64 = self.marks[:self.nbytes // 8 * 8].view(np.uint64)
        """The record as words (``_needing``'s look at eight granules at once)."""
        self.marked = 0
        """Blocks this process marked (CPU reads)."""
        self.invalidated = 0
        """Blocks a GPU read of this process had to invalidate."""
        self.skipped = 0
        """Blocks a GPU read of this process read without invalidating."""

    def mark(self, poffs: np.ndarray, rel: int, span: int) -> None:
        """The CPU read ``[poff + rel, +span)`` of each block (payload offsets ``poffs``)."""
        _mark(self.marks, np.ascontiguousarray(poffs, dtype=np.int64), rel, span, GRANULE_SHIFT)
        self.marked += len(poffs)

    def needing(self, poffs: np.ndarray, rel: int, span: int) -> np.ndarray:
        """The payload offsets among ``poffs`` whose range ``[poff + rel, +span)`` has a marked
        granule: what a GPU read of that range must invalidate first."""
        p = np.ascontiguousarray(poffs, dtype=np.int64)
        out = np.empty(p.shape[0], dtype=np.int64)
        k = int(_needing(self.marks, self.marks64, p, rel, span, GRANULE_SHIFT, out))
        self.invalidated += k
        self.skipped += p.shape[0] - k
        return out[:k]

    def clear(self, poffs: np.ndarray, rel: int, span: int) -> None:
        """Forget the granules wholly inside each ``[poff + rel, +span)``: call *before* the
        invalidation of those ranges (a CPU read racing it then marks again, or is dropped)."""
        _clear(self.marks, np.ascontiguousarray(poffs, dtype=np.int64), rel, span,
               GRANULE_SHIFT)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "marked": self.marked, "invalidated": self.invalidated,
                "skipped": self.skipped}

    def close(self) -> None:
        self.marks = np.zeros(0, dtype=np.uint8)
        self.marks64 = np.zeros(0, dtype=np.uint64)
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass          # a view still alive (a caller's slice): the mapping goes with it


SWEEP_GRANULES = 1024
"""Granules one sweep step looks at (4 MiB of region; at most ~0.1-0.2 ms of invalidation
when all are marked), between two looks at the stop flag."""


class Sweeper:
    """Walks a record once in a daemon thread, clearing and invalidating every marked granule
    (module docstring). ``stop()`` returns only once the thread is out of the region: call it
    before the mapping goes away. Only for the hardware backend (the sim's private cache model
    is per thread and not thread-safe; and there the first reads must still invalidate, which
    is what its tests look at)."""

    def __init__(self, marks: CpuMarks, mem: Any, site: int) -> None:
        self.marks = marks
        self.mem = mem
        self.site = site
        self.swept = 0
        """Granules found marked and invalidated so far."""
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tract-cpumarks-sweep",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            marks = self.marks.marks
            total = marks.shape[0]
            scratch = np.empty(SWEEP_GRANULES, dtype=np.int64)
            for g0 in range(0, total, SWEEP_GRANULES):
                if self._stop.is_set():
                    return
                self.swept += int(_sweep(marks, self.mem, g0, min(total, g0 + SWEEP_GRANULES),
                                         GRANULE_SHIFT, self.site, scratch))
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def remove(region_path: str, uuid_hex: str | None) -> None:
    """Remove the record of a region being removed (no error if there is none)."""
    paths = [os.path.abspath(region_path) + ".cpumarks"]
    if uuid_hex:
        paths.append(sidecar_path("/nonexistent/x", uuid_hex))
    for p in paths:
        try:
            os.unlink(p)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            pass
