"""The CPU copy back-end beneath the region store: private memory <-> region, by plan rows.

Where a copy runs. A thread hop (hand the copy to a worker, wake the loop when it is done)
costs ~50-150 µs, so small copies (``INLINE_COPY_BYTES``) run on the event loop's own thread.
From ``PARALLEL_COPY_BYTES`` up a copy runs on several threads at once: the copy gang's
workers, with the loop's own thread copying one group itself (``loop_share``, for groups of at
most ``LOOP_SHARE_MAX_BYTES``), so that the loop never sleeps through a mid-size copy and pays
its wake-up. A copy that gets one thread only runs on the loop's thread up to
``LOOP_SHARE_MAX_BYTES`` too; larger ones, and every copy with ``loop_share=False``, run on the
copier's own pool (not the loop's default executor, which the lock waits and polls share).

Copies on several threads. One core's non-temporal stream does not reach a host's memory
bandwidth: on a 16-core H200 host the single-threaded write kernel ran at 7.7-14.5 GB/s and the
read kernel (every line invalidated first, so every line comes from DRAM) at 4.7-5.8 GB/s, while
torch's multi-threaded ``copy_`` reached ~31-39 GB/s at 256 MiB. So such a copy is cut into row
groups of about equal bytes (``split_plan``; a row bigger than its share is cut too, at a 4 KiB
boundary of its region address, so that a single 256 MiB row still spreads) and each group runs
on its own thread. The kernels release the GIL, so the threads copy in parallel. The groups go
to the copier's ``CopyGang`` (``stores/copygang.py``: persistent workers that never take the
GIL, woken by eventfds) when it is idle; a copy that finds it busy, or a wrapped copy function,
takes the thread pool, whose threads cost two GIL hand-offs each, one after the other (on the
H200 host ~50 µs per thread: a 2 MiB put on two pool threads took 514 µs, on the loop's thread
110 µs).

How many threads (``threads_for``): at most ``copy_threads`` (``EngineConfig.copy_threads``;
None sizes it from the host, ``auto_copy_threads``: half the cores, at most 8, so one thread on a
2-core VM, where a second thread only competes with the loop, the lock manager and the
heartbeat), and at most one per ``THREAD_MIN_BYTES`` of the copy. Until 2026-12-04 only copies of
8 MiB and more were cut, always into ``copy_threads`` groups; a layer of a layer-streamed 16 MiB
handoff (4 MiB) then ran on one thread, and the consumer's read of it at ~5 GB/s was the
slowest step of the handoff on the H200 host (README, Results).

What each direction keeps:

* a put's group is a whole ``copy_in`` (``write_rows``): non-temporal stores, the edge-line
  flushes of its rows, then its own ``sfence`` -- a fence orders only its own core's stores,
  so every thread fences what it wrote, and the caller publishes only after every thread has
  returned (the future's completion orders the fenced stores before the publishing stores);
* a get's group is a whole ``copy_out``/``copy_out_nt`` (``read_rows``): it drops every line of
  its rows, ``mfence``, then copies them, so no byte is read from a line that was not
  invalidated first (the invalidate-before-read rule, per thread; a line shared by two groups'
  edges is dropped by both, which is harmless for a read);
* the call returns only when every thread is done, also when the caller is cancelled (the
  threads cannot be interrupted; a cancelled caller must not free memory that a thread still
  copies: docs/design.md invariant 7), and then raises the first thread's error, if any.

The sim backend stays on one thread (its caches are per thread: ``waits.ThreadMem``). The older
two-thread read (one thread drops the lines ahead, the other copies behind: ``_copy_out_split``)
is kept for ``copy_read_ahead=True``: large reads then take that pair whatever ``copy_threads``
says (puts still follow ``copy_threads``).

The copy functions are looked up in ``region/index.py`` at every call (tests wrap them there).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from typing import Any

import numpy as np

import tract_kernels as K

from ..region import Region
from ..region import gangcopy as G
from ..region import index as ix
from ..sync.settle import settled
from . import waits
from .copygang import CopyGang
from .phases import PhaseTimes
from . import routing as R

SPLIT_ALIGN = 4096
"""A row cut between two groups is cut at a multiple of this in the region (a page: the two
threads never write parts of one region line)."""

MAX_AUTO_COPY_THREADS = 8

_GANG_KINDS = ((ix.copy_in, G.KIND_PUT), (ix.copy_out, G.KIND_GET), (ix.copy_out_nt, G.KIND_GET_NT))
"""The kernels a gang worker runs, with their job kinds. A wrapped copy function (a test
watching the threads) is not among them and takes the thread pool."""


def _gang_kind(fn: Any) -> int | None:
    for f, kind in _GANG_KINDS:
        if fn is f:
            return kind
    return None


def auto_copy_threads(cpus: int | None = None) -> int:
    """Copy threads for ``copy_threads=None``: half the CPUs this process may run on
    (``cpus``, default ``waits.usable_cpus()``: its affinity mask; the other half runs the
    loop, the lock manager, the heartbeat and the caller's own work), between 1 and 8 (a cap,
    not a measured optimum: a few streams already draw most of a socket's bandwidth)."""
    n = waits.usable_cpus() if cpus is None else cpus
    return max(1, min(MAX_AUTO_COPY_THREADS, n // 2))


threads_for = R.threads_for
"""``routing.threads_for`` (the copy paths and their tests name it here too)."""


def split_plan(plan: np.ndarray, parts: int, align: int = SPLIT_ALIGN) -> list[np.ndarray]:
    """``plan``'s rows as at most ``parts`` contiguous plans of about equal bytes, in order.

    The cut between two groups falls at byte ``total * k // parts`` of the concatenated rows,
    moved to the nearest multiple of ``align`` of the region address; a row containing a cut is
    split in two rows there (both columns advance by the same amount). Groups that would be
    empty are left out. Each plan is a fresh C-contiguous int64 array (what the kernels take)."""
    n = plan.shape[0]
    sizes = plan[:, 2]
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if n else 0
    if parts <= 1 or total <= 0:
        return [np.ascontiguousarray(plan, dtype=np.int64)]
    cuts: list[tuple[int, int]] = [(0, 0)]           # (row, bytes of that row before the cut)
    for k in range(1, parts):
        at = total * k // parts
        r = int(np.searchsorted(ends, at, side="right"))   # the row holding byte ``at``
        if r >= n:
            continue
        start = int(ends[r] - sizes[r])
        roff = int(plan[r, 0])
        addr = roff + (at - start)
        addr = (addr + align // 2) // align * align
        within = min(max(addr - roff, 0), int(sizes[r]))
        if within >= int(sizes[r]):
            r, within = r + 1, 0
        if r < n and (r, within) > cuts[-1]:      # a cut at the very end is the end
            cuts.append((r, within))
    cuts.append((n, 0))
    out: list[np.ndarray] = []
    for (r0, b0), (r1, b1) in zip(cuts, cuts[1:]):
        if r0 == r1:
            rows = plan[r0:r0 + 1].astype(np.int64, copy=True)
            rows[0, :2] += b0
            rows[0, 2] = b1 - b0
        else:
            last = r1 + 1 if b1 > 0 else r1
            rows = plan[r0:last].astype(np.int64, copy=True)
            rows[0, :2] += b0
            rows[0, 2] -= b0
            if b1 > 0:
                rows[-1, 2] = b1
        if rows.shape[0] and int(rows[:, 2].sum()) > 0:
            out.append(np.ascontiguousarray(rows))
    return out


class CpuCopier:
    """Copies between private memory and one region, on the loop or on its own threads.

    ``copy_threads``: the most threads one copy runs on (None: ``auto_copy_threads()``).
    ``read_ahead``: large reads take the two-thread drop-ahead pair (``copy_read_ahead``).
    ``gang``: cut copies run on a ``CopyGang`` (GIL-free workers) when it is idle, else on the
    thread pool; False: always the pool (benchmarks compare the two).
    ``loop_share``: the loop's thread copies a share itself (``LOOP_SHARE_MAX_BYTES``); False:
    it only waits (tests of the workers' own mechanics use that).
    ``phases``: where a benchmark wants the copy's time (``copy_call``, ``copy_kernel``)."""

    def __init__(self, region: Region, *, copy_threads: int | None = None,
                 read_ahead: bool = False, gang: bool = True, loop_share: bool = True) -> None:
        self.region = region
        self.loop_share = loop_share
        self.copy_threads = auto_copy_threads() if copy_threads is None else copy_threads
        self.read_ahead = read_ahead
        self.use_gang = gang
        self.phases: PhaseTimes | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._gang: CopyGang | None = None
        self.gang_copies = 0
        """Copies the gang ran (the rest of the cut ones ran on the pool)."""
        self.loop_shares = 0
        """Gang copies of which the loop's thread copied a group itself
        (``LOOP_SHARE_MAX_BYTES``)."""

    def _copy_pool(self) -> cf.ThreadPoolExecutor:
        """The copy threads (created on the first threaded copy; ``shutdown``)."""
        if self._pool is None:
            n = max(2, self.copy_threads)
            pool = self._pool = cf.ThreadPoolExecutor(max_workers=n,
                                                      thread_name_prefix="tract-copy")
            # every thread now, not one inside a later copy's submission: the executor starts a
            # thread only when none is idle, and a start waits for the new thread, which lets
            # the GIL go in the middle of posting a copy (a pool thread then ran its item's
            # Python while the loop was still posting: the copy gang test's negative control
            # failed so in a clean-clone CI, session 45). Each item waits at a barrier until
            # all n run, so no thread is idle when the next is submitted: n threads start.
            gate = threading.Barrier(n)
            for _ in range(n):
                pool.submit(gate.wait, 10.0)
        return self._pool

    def shutdown(self) -> None:
        """Stop the copy threads (idle by now: every copy is awaited to its end). Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        gang, self._gang = self._gang, None
        if gang is not None:
            gang.close()

    def idle_gang(self) -> CopyGang | None:
        """The gang, made on first use, when it can take a copy now (idle, this loop)."""
        if not self.use_gang or self.copy_threads < 2:
            return None
        if self._gang is None:
            self._gang = CopyGang(self.copy_threads)
        g = self._gang
        return g if g.idle and g.serves(asyncio.get_running_loop()) else None

    def _threads(self, nbytes: int) -> int:
        if self.region.mem[K.MEM_BACKEND] != K.BACKEND_HW:
            return 1
        return threads_for(nbytes, self.copy_threads)

    async def copy_in(self, plan: np.ndarray, src_addr: int, nbytes: int, *,
                      threads: int | None = None, loop_share: bool = True) -> None:
        """Copy private bytes at ``src_addr`` into the region by plan rows (region offset,
        source offset, nbytes); in memory on return (the CUDA pinned fallback uses it too).
        Large copies run on several threads, each ending in its own ``sfence`` (module doc).
        ``threads``: how many for a copy above ``INLINE_COPY_BYTES`` on the hardware backend
        (None: ``threads_for``; benchmarks set it). ``loop_share=False``: the loop's thread
        copies nothing of a copy above ``INLINE_COPY_BYTES`` (a staged put keeps it for the
        next stage's reservation: ``stores/region.py``)."""
        await self._copy(ix.copy_in, plan, src_addr, nbytes, threads, loop_share)

    async def copy_out(self, plan: np.ndarray, dst_addr: int, nbytes: int, *,
                       threads: int | None = None) -> None:
        """Copy region bytes to private memory at ``dst_addr`` by plan rows; every line is
        invalidated before it is read (on each thread, for a large read: module doc).
        ``threads``: as for ``copy_in``."""
        if (threads is None and nbytes >= R.NT_READ_BYTES and self.read_ahead
                and self.region.mem[K.MEM_BACKEND] == K.BACKEND_HW):
            ph = self.phases
            t0 = time.perf_counter_ns() if ph is not None else 0
            await self._copy_out_split(plan, dst_addr)
            if ph is not None:       # two threads: their wall time is the kernel's
                ph.add("copy_call", t0)
                ph.add("copy_kernel", t0)
        else:
            fn = ix.copy_out_nt if nbytes >= R.NT_READ_BYTES else ix.copy_out
            await self._copy(fn, plan, dst_addr, nbytes, threads)

    async def _copy(self, fn: Any, plan: np.ndarray, base: int, nbytes: int,
                    threads: int | None = None, loop_share: bool = True) -> None:
        ph = self.phases
        t0 = time.perf_counter_ns() if ph is not None else 0
        if nbytes <= R.INLINE_COPY_BYTES:
            fn(self.region.mem, plan, base)
            if ph is not None:
                ph.add("copy_call", t0)
                ph.add("copy_kernel", t0)
            return
        parts = self._threads(nbytes) if threads is None else threads
        hw = self.region.mem[K.MEM_BACKEND] == K.BACKEND_HW
        loop_share = loop_share and self.loop_share
        if (parts <= 1 and threads is None and hw and loop_share
                and nbytes <= R.LOOP_SHARE_MAX_BYTES):
            fn(self.region.mem, plan, base)     # one thread: the loop's own (no hop)
            if ph is not None:
                ph.add("copy_call", t0)
                ph.add("copy_kernel", t0)
            return
        if parts > 1 and hw:
            groups = split_plan(plan, parts)
            if len(groups) > 1:
                kind = _gang_kind(fn)
                gang = self.idle_gang() if kind is not None else None
                share = (loop_share and
                         max(int(g[:, 2].sum()) for g in groups) <= R.LOOP_SHARE_MAX_BYTES)
                if gang is not None and len(groups) - share <= gang.workers:
                    self.gang_copies += 1
                    if share:
                        self.loop_shares += 1
                        await gang.run(kind, self.region.mem, groups[1:], base,
                                       own=(fn, groups[0]))
                    else:
                        await gang.run(kind, self.region.mem, groups, base)
                else:
                    await self._run_all([(fn, g, base) for g in groups], self._copy_pool())
                if ph is not None:   # several threads: their wall time is the kernel's
                    ph.add("copy_call", t0)
                    ph.add("copy_kernel", t0)
                return
        if ph is not None:
            fn = _timed(fn, ph)
        # the sim's worker thread: the loop's executor, as always (its caches are per thread);
        # the hardware backend: the copier's own threads
        ex = self._copy_pool() if self.region.mem[K.MEM_BACKEND] == K.BACKEND_HW else None
        await self._run_all([(fn, plan, base)], ex)
        if ph is not None:
            ph.add("copy_call", t0)

    async def _run_all(self, calls: list[tuple[Any, ...]],
                       ex: cf.Executor | None) -> list[Any]:
        """Run each ``(fn, *args)`` as ``fn(thread's mem, *args)`` on a thread of ``ex`` (None:
        the loop's default executor) and return their results once every one is done.

        A copy in a thread cannot be interrupted: a cancelled caller still waits for the last
        byte of every thread before anything is freed (docs/design.md invariant 7), then re-raises
        the cancellation; otherwise the first thread's error (in ``calls`` order) is raised."""
        loop = asyncio.get_running_loop()
        tm = waits.ThreadMem(self.region)    # each thread its own view (``Region.mem``)
        futs = [loop.run_in_executor(ex, waits.resolve_thread_mem, c[0], tm, *c[1:])
                for c in calls]
        try:
            await asyncio.shield(asyncio.wait(futs))
        except asyncio.CancelledError:
            await settled(*futs)              # a second cancel must not cut it short
            for f in futs:                    # retrieved: no "exception never retrieved"
                if not f.cancelled():
                    f.exception()
            raise
        for f in futs:
            if f.exception() is not None:
                raise f.exception()   # type: ignore[misc]
        return [f.result() for f in futs]

    async def _copy_out_split(self, plan: np.ndarray, dst: int) -> None:
        """A large read on two threads: one drops the payload lines ahead, the other copies
        behind it (``K.drop_rows_ahead``; 256 MiB: 13.0-13.8 -> 11.5-11.8 ms on the 2-core VM of
        the third session). Returns once both threads are done, also when cancelled or when one
        of them raised."""
        ctl = np.zeros(2, dtype=np.uint64)            # progress, abort: alive until both end
        # the copying thread spins on the dropping one: both go to the pool in one step, the
        # dropper first, so with the pool's FIFO queue and >= 2 workers a spinning copier's
        # dropper has always been taken already (also with other gets' pairs queued)
        _, stopped = await self._run_all([
            (ix.drop_payload_rows_ahead, plan, ctl.ctypes.data),  # IndexError of a bad row
            (ix.copy_out_behind, plan, np.uint64(dst), ctl.ctypes.data, True)],
            self._copy_pool())
        if stopped:
            raise AssertionError("region store: the copying thread stopped before its rows")


def _timed(fn: Any, ph: PhaseTimes) -> Any:
    """``fn`` that adds its own run time to ``copy_kernel`` (for copies in a worker thread)."""
    def run(*args: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            ph.add("copy_kernel", t0)
    return run
