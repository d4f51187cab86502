"""The region store: put, get and lookup of KV blocks in the shared region, for one node.

The lifecycle of every block (reserve, publish, validate a read, touch, abandon) belongs to
``BlockLifecycle`` (``stores/blocks.py``); this module holds the two copy back-ends beneath it
and picks one per transfer by the tensor's device:

* CPU tensors: the jitted copies of ``region/index.py`` -- inline on the event loop when small
  (a thread hop costs ~50-100 µs), in a worker thread when large, and when large enough
  (``PARALLEL_COPY_BYTES``, hardware backend) on ``copy_threads`` worker threads at once (see
  "Copies on several threads" below);
* CUDA tensors: the DMA path of ``cuda/store.py`` (the region registered with CUDA), reached
  through the engine's ``CudaPath`` so that a CUDA transfer takes the same store dispatch as a
  CPU one -- and the same fallback when the region is full (``stores/fallback.py``).

Copies on several threads. One core's non-temporal stream does not reach a host's memory
bandwidth: on a 16-core H200 host the single-threaded write kernel ran at 7.7 GB/s at 256 MiB
and the read kernel at ~4-8 GB/s, while torch's multi-threaded ``copy_`` reached ~31 GB/s. So a
copy of at least ``PARALLEL_COPY_BYTES`` on the hardware backend is cut into ``copy_threads``
groups of rows of about equal bytes (``split_plan``; a row bigger than its share is cut too, at
a 4 KiB boundary of its region address, so that a single 256 MiB row still spreads) and each
group runs on its own thread of a pool the store owns (``_copy_pool``: not the loop's default
executor, which the lock waits and polls share). The kernels release the GIL, so the threads
copy in parallel. ``copy_threads=None`` sizes the pool from the host
(``auto_copy_threads``: half the cores, at most 8: one thread on a 2-core VM, where a second
thread only competes with the loop, the lock manager and the heartbeat).

What each direction keeps:

* a put's group is a whole ``copy_in`` (``write_rows``): non-temporal stores, the edge-line
  flushes of its rows, then its own ``sfence`` -- a fence orders only its own core's stores,
  so every thread fences what it wrote, and the caller publishes only after every thread has
  returned (the future's completion orders the fenced stores before the publishing stores);
* a get's group is a whole ``copy_out_nt`` (``read_rows``): it drops every line of its rows,
  ``mfence``, then copies them, so no byte is read from a line that was not invalidated first
  (the invalidate-before-read rule, per thread; a line shared by two groups' edges is dropped by
  both, which is harmless for a read);
* the call returns only when every thread is done, also when the caller is cancelled (the
  threads cannot be interrupted; a cancelled caller must not free memory that a thread still
  copies: DESIGN.md invariant 7), and then raises the first thread's error, if any.

The sim backend stays on one thread (its caches are per thread: ``waits.ThreadMem``). The older
two-thread read (one thread drops the lines ahead, the other copies behind: ``_copy_out_split``)
is kept for ``copy_read_ahead=True``: large reads then take that pair whatever ``copy_threads``
says (puts still follow ``copy_threads``).

Yielding to this node's lock. A small put or get (the fused kernels, an inline copy) completes
without suspending, so a caller's loop of them never lets other tasks of its event loop run.
One of those tasks may be waiting for the global lock (the engine's maintenance flushing LRU
touches): once the manager grants it, the rack's lock is held by a task that cannot run, and
every other node's reservation waits until the loop of transfers ends (the disagreement
stress's intermittent LockTimeout: a reader's get loop held the rack's lock for 9 s). So each
put and get first yields one loop turn (``asyncio.sleep(0)``) while any task of this process
waits for or holds the lock (``GlobalLock.wanted``: one attribute read when nobody does). A
granted waiter then runs within two transfers. A loop that never awaits anything still stalls
it: only the heartbeat is immune to that (``engine.py``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import sys
import time
from typing import Any, Callable

import numpy as np

import tract_kernels as K

from .. import arrays
from ..config import EngineConfig
from ..gcpause import PAUSE_MIN_BLOCKS, gc_paused
from ..keys import keys_to_words
from ..region import Region
from ..region import index as ix
from ..region.alloc import Allocator
from ..sync.lock import GlobalLock
from . import fused
from . import plan as kvplan
from . import waits
from .blocks import BlockLifecycle, StoreStats
from .phases import PhaseTimes

INLINE_COPY_BYTES = 1 << 20
"""Copies up to this size run on the event loop (a thread hop costs ~50-100 µs here)."""

NT_READ_BYTES = 8 << 20
"""Gets at least this large write their output with non-temporal stores (``read_rows``)."""

PARALLEL_COPY_BYTES = 8 << 20
"""Copies at least this large (hardware backend) run on ``copy_threads`` threads: below it a
group's share is cache-sized and the extra thread hops (~50-100 µs each) outweigh the gain."""

SPLIT_ALIGN = 4096
"""A row cut between two groups is cut at a multiple of this in the region (a page: the two
threads never write parts of one region line)."""

MAX_AUTO_COPY_THREADS = 8


def auto_copy_threads(cpus: int | None = None) -> int:
    """Copy threads for ``copy_threads=None``: half the host's cores (the other half runs the
    loop, the lock manager, the heartbeat and the caller's own work), between 1 and 8 (a cap,
    not a measured optimum: a few streams already draw most of a socket's bandwidth)."""
    n = os.cpu_count() if cpus is None else cpus
    return max(1, min(MAX_AUTO_COPY_THREADS, (n or 1) // 2))


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


class RegionStore:
    """put / get / lookup over one region for one node. Created and owned by the Engine.

    ``cuda_path``: returns the engine's CudaPath (registering the region on first use); the
    store calls it only for CUDA tensors."""

    def __init__(self, cfg: EngineConfig, region: Region, lock: GlobalLock,
                 allocator: Allocator, index: ix.PrefixIndex, *,
                 cuda_path: Callable[[], Any] | None = None) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.region = region
        self.blocks = BlockLifecycle(cfg, region, lock, allocator, index)
        self._cuda_path = cuda_path
        self.phases: PhaseTimes | None = None
        """Per-phase timings for benchmarks (``stores/phases.py``); None: not measured."""
        self.copy_threads = (auto_copy_threads() if cfg.copy_threads is None
                             else cfg.copy_threads)
        """Threads a large copy runs on (``cfg.copy_threads``, None resolved from the host)."""
        self._pool: cf.ThreadPoolExecutor | None = None
        self._tmpls: dict[int, np.ndarray] = {}
        self.yield_to_lock = True
        """Yield one loop turn before a transfer while a task of this process waits for or
        holds the global lock ("Yielding to this node's lock"). Off only in the negative
        control of the test that shows why."""

    def _fusable(self, n: int, layer: int | None) -> bool:
        """A transfer the fused kernels take (``stores/fused.py``): whole blocks, at most
        ``FUSED_MAX_BLOCKS`` of them, and small enough to copy on the loop's thread (larger
        copies run on the copy threads)."""
        return (layer is None and n <= fused.FUSED_MAX_BLOCKS
                and n * self.layout.block_bytes <= INLINE_COPY_BYTES)

    def _template(self, n: int) -> np.ndarray:
        """The whole-block plan template of an n-block tensor (``plan.template``), cached."""
        t = self._tmpls.get(n)
        if t is None:
            t = self._tmpls[n] = kvplan.template(self.layout, n)
        return t

    # -- what the engine and tools read -------------------------------------------------------
    @property
    def index(self) -> ix.PrefixIndex:
        return self.blocks.index

    @property
    def alloc(self) -> Allocator:
        return self.blocks.alloc

    @property
    def stats(self) -> StoreStats:
        return self.blocks.stats

    @property
    def geo(self) -> ix.IndexGeometry:
        return self.blocks.geo

    @property
    def mem(self) -> K.Mem:
        return self.region.mem

    def lookup(self, keys: list[bytes]) -> int:
        return self.blocks.lookup(keys)

    # -- CPU copy back-end ------------------------------------------------------------------
    def _copy_pool(self) -> cf.ThreadPoolExecutor:
        """The store's copy threads (created on the first large copy; ``shutdown_copies``)."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=max(2, self.copy_threads),
                                               thread_name_prefix="tract-copy")
        return self._pool

    def start_waking(self) -> None:
        """Put this node's doorbell on the running loop (``stores/doorbell.py``)."""
        self.blocks.doorbell.start()

    def stop_waking(self) -> None:
        """Take the doorbell off the loop; later waits poll. Idempotent."""
        self.blocks.doorbell.stop()

    def shutdown_copies(self) -> None:
        """Stop the copy threads (idle by now: every copy is awaited to its end). Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _parallel(self, nbytes: int) -> bool:
        return (nbytes >= PARALLEL_COPY_BYTES and self.copy_threads >= 2
                and self.mem[K.MEM_BACKEND] == K.BACKEND_HW)

    async def _copy(self, fn: Any, plan: np.ndarray, base: int, nbytes: int) -> None:
        ph = self.phases
        t0 = time.perf_counter_ns() if ph is not None else 0
        if nbytes <= INLINE_COPY_BYTES:
            fn(self.mem, plan, base)
            if ph is not None:
                ph.add("copy_call", t0)
                ph.add("copy_kernel", t0)
            return
        if self._parallel(nbytes):
            groups = split_plan(plan, self.copy_threads)
            if len(groups) > 1:
                await self._run_all([(fn, g, base) for g in groups], self._copy_pool())
                if ph is not None:   # several threads: their wall time is the kernel's
                    ph.add("copy_call", t0)
                    ph.add("copy_kernel", t0)
                return
        if ph is not None:
            fn = _timed(fn, ph)
        # the sim's worker thread: the loop's executor, as always (its caches are per thread);
        # the hardware backend: the store's own copy threads
        ex = self._copy_pool() if self.mem[K.MEM_BACKEND] == K.BACKEND_HW else None
        await self._run_all([(fn, plan, base)], ex)
        if ph is not None:
            ph.add("copy_call", t0)

    async def _run_all(self, calls: list[tuple[Any, ...]],
                       ex: cf.Executor | None) -> list[Any]:
        """Run each ``(fn, *args)`` as ``fn(thread's mem, *args)`` on a thread of ``ex`` (None:
        the loop's default executor) and return their results once every one is done.

        A copy in a thread cannot be interrupted: a cancelled caller still waits for the last
        byte of every thread before anything is freed (DESIGN.md invariant 7), then re-raises
        the cancellation; otherwise the first thread's error (in ``calls`` order) is raised."""
        loop = asyncio.get_running_loop()
        tm = waits.ThreadMem(self.region)    # each thread its own view (``Region.mem``)
        futs = [loop.run_in_executor(ex, waits.resolve_thread_mem, c[0], tm, *c[1:])
                for c in calls]
        try:
            await asyncio.shield(asyncio.wait(futs))
        except asyncio.CancelledError:
            while not all(f.done() for f in futs):     # a second cancel must not cut it short
                try:
                    await asyncio.wait(futs)
                except asyncio.CancelledError:
                    pass
            for f in futs:                    # retrieved: no "exception never retrieved"
                if not f.cancelled():
                    f.exception()
            raise
        for f in futs:
            if f.exception() is not None:
                raise f.exception()   # type: ignore[misc]
        return [f.result() for f in futs]

    async def copy_in(self, plan: np.ndarray, src_addr: int, nbytes: int) -> None:
        """Copy private bytes at ``src_addr`` into the region by plan rows (region offset,
        source offset, nbytes); in memory on return (the CUDA pinned fallback uses it too).
        Large copies run on several threads, each ending in its own ``sfence`` (module doc)."""
        await self._copy(ix.copy_in, plan, src_addr, nbytes)

    async def copy_out(self, plan: np.ndarray, dst_addr: int, nbytes: int) -> None:
        """Copy region bytes to private memory at ``dst_addr`` by plan rows; every line is
        invalidated before it is read (on each thread, for a large read: module doc)."""
        if (nbytes >= NT_READ_BYTES and self.cfg.copy_read_ahead
                and self.mem[K.MEM_BACKEND] == K.BACKEND_HW):
            ph = self.phases
            t0 = time.perf_counter_ns() if ph is not None else 0
            await self._copy_out_split(plan, dst_addr)
            if ph is not None:       # two threads: their wall time is the kernel's
                ph.add("copy_call", t0)
                ph.add("copy_kernel", t0)
        else:
            fn = ix.copy_out_nt if nbytes >= NT_READ_BYTES else ix.copy_out
            await self._copy(fn, plan, dst_addr, nbytes)

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

    # -- put ----------------------------------------------------------------------------------
    async def put(self, keys: list[bytes], kv: Any, layer: int | None,
                  timeout: float | None) -> int:
        """Store blocks not yet present; returns how many this call stored (or filled).
        Raises RegionFull (nothing stored), TransferTimeout, NodeEvicted."""
        if self.yield_to_lock and self.blocks.lock.wanted:
            await asyncio.sleep(0)
        if arrays.is_cuda(kv):
            return await self._put_cuda(keys, kv, layer, timeout)
        if len(keys) < PAUSE_MIN_BLOCKS:     # skip the context manager (~1 µs) when it is a no-op
            return await self._put(keys, kv, layer, timeout)
        with gc_paused(len(keys)):
            return await self._put(keys, kv, layer, timeout)

    async def _put(self, keys: list[bytes], kv: Any, layer: int | None,
                   timeout: float | None) -> int:
        b, ph = self.blocks, self.phases
        kv = arrays.contiguous(kv)
        words = keys_to_words(keys)
        t0 = time.perf_counter_ns() if ph is not None else 0
        if self._fusable(len(keys), layer):
            done = b.put_fused(keys, words, arrays.data_ptr(kv), self._template(len(keys)))
            if done is not None:
                if ph is not None:      # the publish ended the kernel: stamp it on return
                    ph.add("fused", t0)
                    ph.stamp("publish")
                return done
        snap = b.snapshot(words)
        if ph is not None:
            ph.add("snapshot", t0)
            t0 = time.perf_counter_ns()
        todo = await b.reserve(keys, words, snap, timeout)
        if ph is not None:
            ph.add("reserve_incl_lock", t0)
        if not todo:
            b.stats.puts += 1
            return 0
        res = b.reservations(keys, todo)
        poffs = np.fromiter((r.offset for r in res), dtype=np.int64,
                            count=len(res))
        plan = kvplan.plan(self.layout, poffs, np.array(todo), len(keys), layer)
        nbytes = plan.shape[0] * self.layout.half_layer_bytes     # every row is one half-layer
        try:
            await self.copy_in(plan, arrays.data_ptr(kv), nbytes)
        except BaseException:
            await b.abandon([keys[i] for i in todo])
            raise
        if ph is not None:
            ph.stamp("publish")
        t0 = time.perf_counter_ns() if ph is not None else 0
        done = b.publish(keys, todo, res, layer, nbytes)
        if ph is not None:
            ph.add("publish", t0)
        return done

    async def _put_cuda(self, keys: list[bytes], kv: Any, layer: int | None,
                        timeout: float | None) -> int:
        from ..cuda import store as cs
        if self._cuda_path is None:
            raise AssertionError("region store: a CUDA tensor reached a store built without "
                                 "the engine's CUDA path")
        cpath = self._cuda_path()
        fut = await cs.start_put(self, cpath, keys, [kv],
                                 cs.contiguous_plan_fn(self.layout, len(keys), layer), layer,
                                 timeout)
        return await cs.finish_put(self, cpath, keys, fut)

    # -- get ----------------------------------------------------------------------------------
    async def get(self, keys: list[bytes], out: Any, layer: int | None,
                  timeout: float | None) -> Any:
        """Read ``keys`` into ``out`` (CPU or CUDA). Raises BlockNotFound, LayerNotReady,
        TransferTimeout, BlockEvicted."""
        if self.yield_to_lock and self.blocks.lock.wanted:
            await asyncio.sleep(0)
        if arrays.is_cuda(out):
            return await self._get_cuda(keys, out, layer, timeout)
        if len(keys) < PAUSE_MIN_BLOCKS:     # as in put
            return await self._get(keys, out, layer, timeout)
        with gc_paused(len(keys)):
            return await self._get(keys, out, layer, timeout)

    async def _get(self, keys: list[bytes], out: Any, layer: int | None,
                   timeout: float | None) -> Any:
        b, ph = self.blocks, self.phases
        n = len(keys)
        t0 = time.perf_counter_ns() if ph is not None else 0
        if self._fusable(n, layer):
            words = keys_to_words(keys)
            dst, tmpl = arrays.data_ptr(out), self._template(n)
            snap = b.get_fused(keys, words, dst, tmpl)
            if snap is None and timeout is not None and timeout > 0:
                await b.wait_whole(words, b.fused_snapshot(n), timeout)
                snap = b.get_fused(keys, words, dst, tmpl)
                timeout = None         # waited: the step-by-step path reports what is missing
            if snap is not None:
                if ph is not None:
                    ph.add("fused", t0)
                if self.cfg.mode == "transfer":
                    await b.consume(keys, words, snap.copy(), layer)
                return out
        words, snap = await b.prepare_read(keys, layer, timeout)
        if ph is not None:
            ph.add("prepare_read", t0)
        if b.pause_after_snapshot is not None:
            await b.pause_after_snapshot()
        plan = kvplan.plan(self.layout, snap[:, 3], np.arange(n), n, layer)
        nbytes = plan.shape[0] * self.layout.half_layer_bytes     # every row is one half-layer
        await self.copy_out(plan, arrays.data_ptr(out), nbytes)
        t0 = time.perf_counter_ns() if ph is not None else 0
        b.validate_read(keys, words, snap, nbytes)
        if ph is not None:
            ph.add("validate", t0)
        await b.consume(keys, words, snap, layer)
        return out

    async def _get_cuda(self, keys: list[bytes], out: Any, layer: int | None,
                        timeout: float | None) -> Any:
        from ..cuda import store as cs
        if self._cuda_path is None:
            raise AssertionError("region store: a CUDA tensor reached a store built without "
                                 "the engine's CUDA path")
        cpath = self._cuda_path()
        fut = await cs.start_get(self, cpath, keys, [out],
                                 cs.contiguous_plan_fn(self.layout, len(keys), layer), layer,
                                 timeout, result=out,
                                 after=sys.modules["torch"].cuda.current_stream(out.device))
        return await cs.finish_get(self, cpath, keys, fut, layer)

    # -- maintenance --------------------------------------------------------------------------
    async def maintain(self, timeout: float) -> None:
        await self.blocks.maintain(timeout)

    def on_reclaim(self, node_id: int, spans: list[tuple[int, int]]) -> None:
        self.blocks.on_reclaim(node_id, spans)

    async def close(self, timeout: float) -> None:
        try:
            await self.blocks.close(timeout)
        finally:
            self.shutdown_copies()


def _timed(fn: Any, ph: PhaseTimes) -> Any:
    """``fn`` that adds its own run time to ``copy_kernel`` (for copies in a worker thread)."""
    def run(*args: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            ph.add("copy_kernel", t0)
    return run
