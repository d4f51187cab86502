"""The shared-access kernels: the only code that touches words of the region.

Every protocol (node table, lock, allocator, index) goes through these functions, with a ``Mem``
describing the mapping and the backend:

* ``BACKEND_HW``: real instructions. Loads/stores are monotonic atomics; flush and invalidate are
  ``clflushopt`` (or ``clflush`` where the CPU lacks it) on the line; fences are ``sfence`` /
  ``mfence``; payload writes are non-temporal streaming stores. Correct on non-coherent CXL memory.
* ``BACKEND_SIM``: the same calls through the private write-back cache model of ``sim.py``, so that
  a missing flush or invalidate shows up as a failure on this (coherent) machine.

Rules the protocols follow (docs/design.md invariant 3): writers ``store`` then ``flush`` then
fence; readers ``invalidate`` then fence then ``load``. Composite helpers ``store_flush`` and
``load_fresh`` do exactly that for one word. Each flush or invalidate names its *site*
(``sites.site(...)``) so that a test can remove it alone (``with_skip_site``).

All offsets are bytes from the region base; words are 8-byte aligned. Bounds are checked on every
call (one compare) and violations raise ``IndexError``: a wild offset must never scribble on the
region silently.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
from numba import njit

from . import sim
from .memfields import (MEM_BACKEND, MEM_BASE_ADDR, MEM_CTL_ADDR, MEM_FLUSH_INSN, MEM_SIZE_BYTES,
                        MEM_SKIP_SITE)
from .intrinsics import (aload64, astore64, clflush_line, clflushopt_line, clwb_line, copy32,
                         cpu_pause, load_u8, mfence, nt_copy32, ntstore64, prefetch_line, sfence,
                         store_u8)

BACKEND_HW = 0
BACKEND_SIM = 1

FLUSH_CLFLUSH = 0
FLUSH_CLFLUSHOPT = 1

LINE_BYTES = 64

ENV_BACKEND = "TRACT_MEM_BACKEND"
"""Environment variable that selects the backend when the configuration leaves it open."""


Mem = tuple
"""What every kernel takes: a plain tuple of ten ints (``memfields.py`` names the positions).

Why a plain tuple. Numba types a plain tuple of ints from a cached fingerprint: a call costs
~0.5 µs of dispatch, against ~1.7 µs for the NamedTuple this was before (Numba types a named
tuple's fields one by one in Python on every call; a registered ``typeof_impl`` for it was no
faster), and a 64 KiB put makes about ten kernel calls. Why only ints: a Mem that carried numpy
arrays made Numba increment and decrement each array's reference count around every inlined
word access that could raise (its bounds check) -- atomic instructions, ~50 ns per store.

The arrays behind the addresses: the mapping is its owner's (``Region.buf``; a Mem must not
outlive it). The sim backend's private cache arrays are kept alive here, in ``_SIM_STATES``,
keyed by their ``ctl`` address, until ``release_mem`` (``Region.close`` releases every Mem it
made); ``mem_state`` returns them for inspection. The hardware backend has no private state: its
Mems share one dummy state that is never released."""


class MemState(NamedTuple):
    """The sim backend's private cache of one Mem (``sim.py`` has the layout); dummies on hw."""
    tags: np.ndarray
    lines: np.ndarray
    dirty: np.ndarray
    ctl: np.ndarray


_SIM_STATES: dict[int, MemState] = {}
_HW_STATE = MemState(*sim.new_state(1, 1, 0.0))


def mem_state(m: Mem) -> MemState:
    """The private cache arrays behind ``m`` (sim), or the shared dummies (hw). Raises
    KeyError for a sim Mem already released."""
    if m[MEM_BACKEND] != BACKEND_SIM:
        return _HW_STATE
    return _SIM_STATES[m[MEM_CTL_ADDR]]


def release_mem(m: Mem | None) -> None:
    """Let a sim Mem's private cache go (idempotent; no-op on hw). Kernels must not be given
    ``m`` afterwards. Every Mem with the same cache (``with_skip_site`` copies) goes with it."""
    if m is not None and m[MEM_BACKEND] == BACKEND_SIM:
        _SIM_STATES.pop(m[MEM_CTL_ADDR], None)


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty set where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_backend(backend: str | None) -> int:
    """Map ``"hw"`` / ``"sim"`` / None (environment, default hw) to a backend constant."""
    name = backend if backend is not None else os.environ.get(ENV_BACKEND, "hw")
    if name in ("hw", "hardware", "coherent"):
        return BACKEND_HW
    if name in ("sim", "incoherent"):
        return BACKEND_SIM
    raise ValueError(f"unknown memory backend {name!r}: expected 'hw' or 'sim' "
                     f"(from {'argument' if backend is not None else ENV_BACKEND})")


def make_mem(buf: np.ndarray, backend: str | None = None, *, seed: int = 0,
             evict_prob: float = 1 / 64, cache_lines: int = 4096, skip_site: int = -1) -> Mem:
    """Describe a mapping for the kernels.

    ``buf`` is a uint8 numpy view of the mapping, 64-byte aligned. ``backend`` is ``"hw"``,
    ``"sim"`` or None (``$TRACT_MEM_BACKEND``, default ``"hw"``). ``seed``, ``evict_prob`` and
    ``cache_lines`` shape the sim cache; ``skip_site`` omits one flush/invalidate site.
    Raises ValueError for a misaligned or non-uint8 buffer or an unknown backend.
    """
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise ValueError(f"buf must be a 1-D uint8 array, got {buf.dtype} with ndim {buf.ndim}")
    base = int(buf.ctypes.data)
    if base % LINE_BYTES:
        raise ValueError(f"mapping base {base:#x} is not {LINE_BYTES}-byte aligned")
    be = resolve_backend(backend)
    flags = cpu_flags()
    insn = FLUSH_CLFLUSHOPT if "clflushopt" in flags else FLUSH_CLFLUSH
    if be == BACKEND_SIM:
        st = MemState(*sim.new_state(cache_lines, seed, evict_prob))
    else:
        st = _HW_STATE
    m = (base, int(buf.shape[0]), be, insn, int(skip_site), int(st.tags.ctypes.data),
         int(st.lines.ctypes.data), int(st.dirty.ctypes.data), int(st.ctl.ctypes.data),
         int(st.tags.shape[0]))
    if be == BACKEND_SIM:
        _SIM_STATES[m[MEM_CTL_ADDR]] = st
    return m


def with_skip_site(m: Mem, skip_site: int) -> Mem:
    """The same mapping and private cache, omitting one flush/invalidate site."""
    return m[:MEM_SKIP_SITE] + (int(skip_site),) + m[MEM_SKIP_SITE + 1:]


# ---------------------------------------------------------------------------------------------
# word access


# Why every word kernel is split in two. A raising function inlined with a Mem that held arrays
# made Numba keep a reference to each array across the possible raise: an incref/decref pair per
# array per access. Splitting the kernels (the public kernel branches on the backend and hands
# scalars to an inlined, checked hardware half; the sim half is an ordinary call) removed the
# counting inside some batch kernels (invalidate 131 -> 1.6 ns, load 48 -> 0.8 ns) but not in
# all: three stores in a caller's loop still cost 156 ns. The Mem now holds only integers
# (a plain tuple, ``Mem``), so nothing is counted anywhere; the split stays, as the sim half
# is large.
#
# Why ``forceinline=True`` and not ``inline="always"``. Both put the word kernels' code into
# their callers; ``inline="always"`` does it on Numba's IR, before typing: every call site
# deep-copies the callee's IR and runs Numba's untyped passes on it again (919 inlines in the
# warm-up scenario, a third of its compile time under cProfile). ``forceinline`` marks the
# LLVM function ``alwaysinline``: each kernel is typed and lowered once per signature and LLVM
# inlines it when it links the caller. The warm-up's cold compile (with its helper, CI's
# bounds checks) took 0.77-0.80x the time and CPU of the IR inlining's in three alternating
# pairs (62.6 -> 48.4, 48.8 -> 39.3, 48.2 -> 37.4 s), the machine code kept calls only to the
# kernels that are not inlined, and bench/kernels.py and bench/putget.py stayed within their
# noise (bench/results/vm-20261207-s52/README.md). (A plain call, neither, compiled as fast but
# left 2,500 calls in the machine code.)


@njit(cache=True, nogil=True, forceinline=True)
def _check_word(size_bytes, offset_bytes):
    if offset_bytes < 0 or offset_bytes + 8 > size_bytes or (offset_bytes & 7) != 0:
        raise IndexError("region word offset out of range or misaligned")


@njit(cache=True, nogil=True, forceinline=True)
def _check_range(size_bytes, offset_bytes, nbytes):
    if offset_bytes < 0 or nbytes < 0 or offset_bytes + nbytes > size_bytes:
        raise IndexError("region byte range out of bounds")


@njit(cache=True, nogil=True, forceinline=True)
def _hw_load(base_addr, size_bytes, offset_bytes):
    _check_word(size_bytes, offset_bytes)
    return aload64(np.uint64(base_addr) + np.uint64(offset_bytes))


@njit(cache=True, nogil=True)
def _sim_load(m, offset_bytes):
    _check_word(m[MEM_SIZE_BYTES], offset_bytes)
    return sim.sim_load(m, offset_bytes)


@njit(cache=True, nogil=True, forceinline=True)
def _hw_store(base_addr, size_bytes, offset_bytes, value):
    _check_word(size_bytes, offset_bytes)
    astore64(np.uint64(base_addr) + np.uint64(offset_bytes), value)


@njit(cache=True, nogil=True)
def _sim_store(m, offset_bytes, value):
    _check_word(m[MEM_SIZE_BYTES], offset_bytes)
    sim.sim_store(m, offset_bytes, value)


@njit(cache=True, nogil=True, forceinline=True)
def _hw_store_nt(base_addr, size_bytes, offset_bytes, value):
    _check_word(size_bytes, offset_bytes)
    ntstore64(np.uint64(base_addr) + np.uint64(offset_bytes), value)


@njit(cache=True, nogil=True)
def _sim_store_nt(m, offset_bytes, value):
    _check_word(m[MEM_SIZE_BYTES], offset_bytes)
    sim.sim_store_nt(m, offset_bytes, value)


@njit(cache=True, nogil=True, forceinline=True)
def _hw_flush(base_addr, size_bytes, flush_insn, skip_site, offset_bytes, site):
    if site == skip_site:
        return
    _check_range(size_bytes, offset_bytes, 1)
    if flush_insn == FLUSH_CLFLUSHOPT:
        clflushopt_line(np.uint64(base_addr) + np.uint64(offset_bytes))
    else:
        clflush_line(np.uint64(base_addr) + np.uint64(offset_bytes))


@njit(cache=True, nogil=True)
def _sim_flush(m, offset_bytes, site, keep):
    if site == m[MEM_SKIP_SITE]:
        return
    _check_range(m[MEM_SIZE_BYTES], offset_bytes, 1)
    sim.sim_flush(m, offset_bytes, keep)


@njit(cache=True, nogil=True, forceinline=True)
def _hw_writeback(base_addr, size_bytes, skip_site, offset_bytes, site):
    if site == skip_site:
        return
    _check_range(size_bytes, offset_bytes, 1)
    clwb_line(np.uint64(base_addr) + np.uint64(offset_bytes))


@njit(cache=True, nogil=True, forceinline=True)
def load(m, offset_bytes):
    """Load one 64-bit word (no invalidate: may be stale on incoherent memory)."""
    if m[MEM_BACKEND] == BACKEND_SIM:
        return _sim_load(m, offset_bytes)
    return _hw_load(m[MEM_BASE_ADDR], m[MEM_SIZE_BYTES], offset_bytes)


@njit(cache=True, nogil=True, forceinline=True)
def store(m, offset_bytes, value):
    """Store one 64-bit word (no flush: other nodes may not see it yet)."""
    if m[MEM_BACKEND] == BACKEND_SIM:
        _sim_store(m, offset_bytes, np.uint64(value))
    else:
        _hw_store(m[MEM_BASE_ADDR], m[MEM_SIZE_BYTES], offset_bytes, np.uint64(value))


@njit(cache=True, nogil=True, forceinline=True)
def store_nt(m, offset_bytes, value):
    """Store one 64-bit word non-temporally (``movnti``): it goes to memory with no flush.

    Why: a store + clflushopt of a line costs ~240 ns on this machine kind (the flush waits for
    the dirty line's write-back), a full line of NT stores ~10 ns. Use it for metadata lines a
    writer rewrites whole, or for single words. Warning: weakly ordered, like a flush: ``sfence``
    before any store that publishes it; the words of one line may land in any order until then.
    """
    if m[MEM_BACKEND] == BACKEND_SIM:
        _sim_store_nt(m, offset_bytes, np.uint64(value))
    else:
        _hw_store_nt(m[MEM_BASE_ADDR], m[MEM_SIZE_BYTES], offset_bytes, np.uint64(value))


@njit(cache=True, nogil=True, forceinline=True)
def flush(m, offset_bytes, site):
    """Write back and invalidate the line holding ``offset_bytes`` (clflushopt/clflush).

    Warning: weakly ordered; follow a batch with ``sfence`` (before a dependent store) or
    ``mfence`` (before a dependent load).
    """
    if m[MEM_BACKEND] == BACKEND_SIM:
        _sim_flush(m, offset_bytes, site, False)
    else:
        _hw_flush(m[MEM_BASE_ADDR], m[MEM_SIZE_BYTES], m[MEM_FLUSH_INSN], m[MEM_SKIP_SITE],
                  offset_bytes, site)


@njit(cache=True, nogil=True, forceinline=True)
def invalidate(m, offset_bytes, site):
    """Drop this node's cached copy of the line so that the next load reads memory.

    On x86 this is the same instruction as ``flush`` (there is no invalidate-without-write-back
    for user code); it is a separate kernel because the protocol role differs, and each role has
    its own fault-injection site.
    """
    if m[MEM_BACKEND] == BACKEND_SIM:
        _sim_flush(m, offset_bytes, site, False)
    else:
        _hw_flush(m[MEM_BASE_ADDR], m[MEM_SIZE_BYTES], m[MEM_FLUSH_INSN], m[MEM_SKIP_SITE],
                  offset_bytes, site)


@njit(cache=True, nogil=True, forceinline=True)
def writeback(m, offset_bytes, site):
    """``clwb``: write the line back, possibly keeping it cached. Writer side only."""
    if m[MEM_BACKEND] == BACKEND_SIM:
        _sim_flush(m, offset_bytes, site, True)
    else:
        _hw_writeback(m[MEM_BASE_ADDR], m[MEM_SIZE_BYTES], m[MEM_SKIP_SITE], offset_bytes, site)


@njit(cache=True, nogil=True, forceinline=True)
def store_fence(m):
    """``sfence``: order earlier stores and flushes before later stores (no-op in the sim)."""
    if m[MEM_BACKEND] == BACKEND_HW:
        sfence()


@njit(cache=True, nogil=True, forceinline=True)
def full_fence(m):
    """``mfence``: later loads may not pass earlier stores or flushes (no-op in the sim)."""
    if m[MEM_BACKEND] == BACKEND_HW:
        mfence()


@njit(cache=True, nogil=True, forceinline=True)
def prefetch(m, offset_bytes):
    """Start loading the line of ``offset_bytes`` (``prefetcht0``; a hint: no fault, no
    ordering). Why: a batch that invalidated many scattered lines and fenced then loads each
    from memory; loads one after another in a loop whose branches depend on what they read
    overlap only a few misses. A first pass that prefetches every line once the fence has
    passed keeps many in flight (the line then holds memory as it was after the fence, as a
    load there would). Out-of-range offsets are skipped, not raised: nothing is read. No-op in
    the sim, whose loads go through its cache model."""
    if m[MEM_BACKEND] == BACKEND_HW and 0 <= offset_bytes < m[MEM_SIZE_BYTES]:
        prefetch_line(np.uint64(m[MEM_BASE_ADDR]) + np.uint64(offset_bytes))


@njit(cache=True, nogil=True, forceinline=True)
def store_flush(m, offset_bytes, value, site):
    """Publish one word: store, flush its line, ``mfence``."""
    store(m, offset_bytes, value)
    flush(m, offset_bytes, site)
    full_fence(m)


@njit(cache=True, nogil=True, forceinline=True)
def load_fresh(m, offset_bytes, site):
    """Read one word as memory holds it now: invalidate its line, ``mfence``, load."""
    invalidate(m, offset_bytes, site)
    full_fence(m)
    return load(m, offset_bytes)


@njit(cache=True)            # holds the GIL
def load_fresh_held(m, offset_bytes, site):
    """``load_fresh`` for a caller in Python on a hot path: this keeps the GIL.

    The word-sized kernels here are compiled ``nogil`` for the kernels that inline them. Called
    from Python, each lets the GIL go for a fraction of a microsecond, and any thread waiting
    for it (an engine's CUDA poller while a transfer is due, its heartbeat and lock-manager
    threads, a serving worker's model thread) takes it there and runs first: a put's fence
    check inside a stream of CUDA layer puts took 16-22 µs that way on the 2-core VM, 2.8 µs
    through this (``bench/results/vm-20261207-s50``)."""
    return load_fresh(m, offset_bytes, site)


@njit(cache=True, nogil=True)
def _flush_lines_hw(line_addr, nlines, flush_insn):
    """Flush ``nlines`` consecutive lines from ``line_addr`` (no fence). Hot loop: raw values only."""
    if flush_insn == FLUSH_CLFLUSHOPT:
        for i in range(nlines):
            clflushopt_line(line_addr + np.uint64(i * 64))
    else:
        for i in range(nlines):
            clflush_line(line_addr + np.uint64(i * 64))


@njit(cache=True, nogil=True)
def _drop_lines(m, offset_bytes, nbytes):
    """Write back and drop every line overlapping the range (no fence, no site check)."""
    line = offset_bytes & ~np.int64(63)
    end = offset_bytes + nbytes
    if m[MEM_BACKEND] == BACKEND_SIM:
        while line < end:
            sim.sim_flush(m, line, False)
            line += 64
    else:
        _flush_lines_hw(np.uint64(m[MEM_BASE_ADDR]) + np.uint64(line), (end - line + 63) >> 6,
                        m[MEM_FLUSH_INSN])


@njit(cache=True, nogil=True)
def flush_range(m, offset_bytes, nbytes, site):
    """Flush every line overlapping [offset, offset+nbytes), then ``sfence``."""
    if nbytes <= 0:
        return
    _check_range(m[MEM_SIZE_BYTES], offset_bytes, nbytes)
    if site == m[MEM_SKIP_SITE]:
        return
    _drop_lines(m, offset_bytes, nbytes)
    store_fence(m)


@njit(cache=True, nogil=True)
def invalidate_range(m, offset_bytes, nbytes, site):
    """Invalidate every line overlapping [offset, offset+nbytes), then ``mfence``."""
    if nbytes <= 0:
        return
    _check_range(m[MEM_SIZE_BYTES], offset_bytes, nbytes)
    if site == m[MEM_SKIP_SITE]:
        return
    _drop_lines(m, offset_bytes, nbytes)
    full_fence(m)


# ---------------------------------------------------------------------------------------------
# payload copies


@njit(cache=True, nogil=True)
def _plain_copy(dst_addr, src_addr, nbytes):
    pos = np.int64(0)
    while pos + 32 <= nbytes:
        copy32(dst_addr + np.uint64(pos), src_addr + np.uint64(pos))
        pos += 32
    while pos < nbytes:
        store_u8(dst_addr + np.uint64(pos), load_u8(src_addr + np.uint64(pos)))
        pos += 1


@njit(cache=True, nogil=True)
def nt_copy_raw(dst_addr, src_addr, nbytes):
    """Streaming copy between two addresses: cached head/tail, non-temporal middle, no fence.

    Warning: the head and tail (up to 31 bytes each) are ordinary stores; a caller writing to
    non-coherent memory must flush those two lines (``write_bytes`` does).
    """
    head = np.int64((32 - (dst_addr & np.uint64(31))) & np.uint64(31))
    if head > nbytes:
        head = nbytes
    _plain_copy(dst_addr, src_addr, head)
    pos = head
    while pos + 64 <= nbytes:
        nt_copy32(dst_addr + np.uint64(pos), src_addr + np.uint64(pos))
        nt_copy32(dst_addr + np.uint64(pos + 32), src_addr + np.uint64(pos + 32))
        pos += 64
    while pos + 32 <= nbytes:
        nt_copy32(dst_addr + np.uint64(pos), src_addr + np.uint64(pos))
        pos += 32
    _plain_copy(dst_addr + np.uint64(pos), src_addr + np.uint64(pos), nbytes - pos)


@njit(cache=True, nogil=True)
def write_bytes(m, offset_bytes, src_addr, nbytes, site):
    """Copy private bytes into the region so that they are in memory when this returns.

    Hardware: non-temporal stores for the aligned middle (no flush needed), flush of the at most
    two partially written edge lines, then ``sfence`` so that a later publishing store cannot pass
    the payload. ``site`` names the edge-line flushes.
    """
    if nbytes <= 0:
        return
    _check_range(m[MEM_SIZE_BYTES], offset_bytes, nbytes)
    if m[MEM_BACKEND] == BACKEND_SIM:
        sim.sim_write_bytes_nt(m, offset_bytes, src_addr, nbytes)
        return
    dst = np.uint64(m[MEM_BASE_ADDR]) + np.uint64(offset_bytes)
    nt_copy_raw(dst, src_addr, nbytes)
    if (offset_bytes | nbytes) & 63:   # edge lines written with cached stores (write_rows says why)
        flush(m, offset_bytes, site)
        flush(m, offset_bytes + nbytes - 1, site)
    sfence()


@njit(cache=True, nogil=True)
def read_bytes(m, offset_bytes, dst_addr, nbytes, site):
    """Copy region bytes into private memory as memory holds them now.

    Invalidates every line of the range (``site``), ``mfence``, then copies. Skipping the
    invalidate (fault injection) makes the sim return stale cached lines.
    """
    if nbytes <= 0:
        return
    _check_range(m[MEM_SIZE_BYTES], offset_bytes, nbytes)
    invalidate_range(m, offset_bytes, nbytes, site)
    if m[MEM_BACKEND] == BACKEND_SIM:
        sim.sim_read_bytes(m, offset_bytes, dst_addr, nbytes)
    else:
        _plain_copy(dst_addr, np.uint64(m[MEM_BASE_ADDR]) + np.uint64(offset_bytes), nbytes)


@njit(cache=True, nogil=True)
def write_rows(m, plan, src_base, site):
    """``write_bytes`` for many rows (region_offset, src_offset, nbytes) with one ``sfence``.

    Hardware: non-temporal copies, flush of each row's partial edge lines, then a single fence
    (a fence per row cost 2-3x at 8 KiB rows).
    """
    for i in range(plan.shape[0]):
        _check_range(m[MEM_SIZE_BYTES], plan[i, 0], plan[i, 2])
    if m[MEM_BACKEND] == BACKEND_SIM:
        for i in range(plan.shape[0]):
            sim.sim_write_bytes_nt(m, plan[i, 0], src_base + np.uint64(plan[i, 1]), plan[i, 2])
        return
    for i in range(plan.shape[0]):
        if plan[i, 2] <= 0:
            continue
        nt_copy_raw(np.uint64(m[MEM_BASE_ADDR]) + np.uint64(plan[i, 0]),
                    src_base + np.uint64(plan[i, 1]), plan[i, 2])
        if (plan[i, 0] | plan[i, 2]) & 63:
            # a cached (ordinary) store wrote part of an edge line: write it back. A row that
            # starts and ends on line boundaries went out entirely non-temporal (which also
            # evicts any cached copy of its lines): a clflushopt right behind NT stores costs
            # ~300 ns each (it waits for the write-combining buffer), 2.6x at 8 KiB rows.
            flush(m, plan[i, 0], site)
            flush(m, plan[i, 0] + plan[i, 2] - 1, site)
    sfence()


@njit(cache=True, nogil=True)
def read_rows(m, plan, dst_base, site, nt_dst=False):
    """``read_bytes`` for many rows (region_offset, dst_offset, nbytes): invalidate every row,
    one ``mfence``, then copy them all.

    ``nt_dst``: write the private destination with non-temporal stores (then ``sfence``). For
    reads larger than the cache the destination would be evicted anyway, and ordinary stores
    first read every destination line (read-for-ownership): 256 MiB cold went from 15.3 to
    18.8 GB/s. Small reads keep cached stores: their consumer reads the bytes right away."""
    for i in range(plan.shape[0]):
        _check_range(m[MEM_SIZE_BYTES], plan[i, 0], plan[i, 2])
    if site != m[MEM_SKIP_SITE]:
        for i in range(plan.shape[0]):
            if plan[i, 2] > 0:
                _drop_lines(m, plan[i, 0], plan[i, 2])
        full_fence(m)
    if m[MEM_BACKEND] == BACKEND_SIM:
        for i in range(plan.shape[0]):
            sim.sim_read_bytes(m, plan[i, 0], dst_base + np.uint64(plan[i, 1]), plan[i, 2])
        return
    _copy_rows_prefetched(np.uint64(m[MEM_BASE_ADDR]), plan, dst_base, nt_dst)
    if nt_dst:
        sfence()


PREFETCH_AHEAD = 8192
"""Bytes of the plan's source rows that ``_copy_rows_prefetched`` prefetches ahead of its copy."""
PREFETCH_STEP = 2048
"""Bytes copied between two advances of its prefetch cursor."""


@njit(cache=True, nogil=True)
def _prefetch_rows(base_addr, plan, pr, po, nbytes):
    """Advance a prefetch cursor (row ``pr``, offset ``po`` in it) by ``nbytes`` of the plan's
    concatenated source rows, a ``prefetcht0`` per line; returns the new (row, offset)."""
    n = plan.shape[0]
    k = np.int64(0)
    while k < nbytes and pr < n:
        if po < plan[pr, 2]:
            prefetch_line(base_addr + np.uint64(plan[pr, 0] + po))
            po += 64
            k += 64
        else:
            pr += 1
            po = 0
    return pr, po


@njit(cache=True, nogil=True)
def _copy_rows_prefetched(base_addr, plan, dst_base, nt_dst):
    """Copy plan rows from ``base_addr + region_offset`` to ``dst_base + dst_offset`` (hardware
    backend), with a software prefetch cursor running ``PREFETCH_AHEAD`` bytes ahead of the copy
    through the rows' *concatenated* source bytes -- across the gap to the next row too.

    Why: a layer read takes 16 KiB of every 64 KiB block (blocks are layer-major), and the
    hardware stream prefetcher restarts at every gap: on the 2-core VM a 32 MiB read of 16 KiB
    rows at a 64 KiB stride ran at 12-15 GB/s against ~33 GB/s for the same bytes contiguous,
    and a 128 MiB get layer by layer took 1.5x the time of the same get whole. The cursor issues
    ``prefetcht0`` for the next row's first lines while the current row's last ones are copied.
    Measured on that VM, alternating in one process (NT destination, 32 MiB): strided
    8.4 -> 14.8 GB/s, contiguous 10.6 -> 19.8 GB/s; 4 KiB ahead gave 13.9.
    Callers invalidate every row and fence before this (``read_rows``): a prefetch after that
    fence is a load like any other."""
    n = plan.shape[0]
    # prefetch cursor (row, offset within it), first PREFETCH_AHEAD bytes ahead of the copy
    pr, po = _prefetch_rows(base_addr, plan, 0, np.int64(0), PREFETCH_AHEAD)
    for i in range(n):
        src = base_addr + np.uint64(plan[i, 0])
        dst = dst_base + np.uint64(plan[i, 1])
        nb = plan[i, 2]
        pos = np.int64(0)
        while pos < nb:
            step = min(PREFETCH_STEP, nb - pos)
            if nt_dst:
                nt_copy_raw(dst + np.uint64(pos), src + np.uint64(pos), step)
            else:
                _plain_copy(dst + np.uint64(pos), src + np.uint64(pos), step)
            pos += step
            pr, po = _prefetch_rows(base_addr, plan, pr, po, step)


# ---------------------------------------------------------------------------------------------
# a read split over two threads: one drops lines ahead, the other copies behind it

DROP_AHEAD_BATCH = 8
"""Rows a ``drop_rows_ahead`` thread drops between two fences and progress stores."""


@njit(cache=True, nogil=True)
def drop_rows_ahead(m, plan, ctl_addr, site):
    """Hardware backend: drop every line of the plan's rows, in order, publishing progress for a
    ``read_rows_behind`` thread: after each ``DROP_AHEAD_BATCH`` rows, ``mfence`` (the drops are
    done), then ``ctl[0] = rows dropped``. On a bad row ``ctl[1] = 1`` (the reader stops) and
    IndexError. clflushopt drops the line from every cache of the host's coherence domain, so
    the reader's core cannot hit a stale copy afterwards. (The sim's caches are per thread: it
    has no such thing, hence hardware only.)

    Why: the invalidation pass of a 256 MiB read takes ~3-4 ms of a ~13 ms read on this VM; on a
    second core it runs under the copy instead of before it."""
    n = plan.shape[0]
    for i in range(n):
        if plan[i, 0] < 0 or plan[i, 2] < 0 or plan[i, 0] + plan[i, 2] > m[MEM_SIZE_BYTES]:
            astore64(np.uint64(ctl_addr) + np.uint64(8), np.uint64(1))
            raise IndexError("region byte range out of bounds")
    skip = site == m[MEM_SKIP_SITE]
    i = 0
    while i < n:
        j = min(n, i + DROP_AHEAD_BATCH)
        if not skip:
            for r in range(i, j):
                if plan[r, 2] > 0:
                    _drop_lines(m, plan[r, 0], plan[r, 2])
            full_fence(m)
        astore64(np.uint64(ctl_addr), np.uint64(j))
        i = j


@njit(cache=True, nogil=True)
def read_rows_behind(m, plan, dst_base, ctl_addr, nt_dst):
    """Hardware backend: copy the plan's rows as ``read_rows`` does, each only once the
    ``drop_rows_ahead`` thread's progress word ``ctl[0]`` covers it (spinning with ``pause``;
    it runs ~3x ahead). Returns 1 when that thread gave up (``ctl[1]``), else 0."""
    n = plan.shape[0]
    for i in range(n):
        _check_range(m[MEM_SIZE_BYTES], plan[i, 0], plan[i, 2])
    for i in range(n):
        while aload64(np.uint64(ctl_addr)) <= np.uint64(i):
            if aload64(np.uint64(ctl_addr) + np.uint64(8)) != 0:
                return 1
            cpu_pause()
        if nt_dst:
            nt_copy_raw(dst_base + np.uint64(plan[i, 1]),
                        np.uint64(m[MEM_BASE_ADDR]) + np.uint64(plan[i, 0]), plan[i, 2])
        else:
            _plain_copy(dst_base + np.uint64(plan[i, 1]),
                        np.uint64(m[MEM_BASE_ADDR]) + np.uint64(plan[i, 0]), plan[i, 2])
    if nt_dst:
        sfence()
    return 0
