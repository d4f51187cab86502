"""The region store: put, get and lookup of KV blocks in the shared region, for one node.

The lifecycle of every block (reserve, publish, validate a read, touch, abandon) belongs to
``BlockLifecycle`` (``stores/blocks.py``); this module holds the two copy back-ends beneath it
and picks one per transfer by the tensor's device:

* CPU tensors: ``CpuCopier`` (``stores/cpucopy.py``), the jitted copies of ``region/index.py``
  -- inline on the event loop when small, on worker threads when large;
* CUDA tensors: the DMA path of ``cuda/store.py`` (the region registered with CUDA), reached
  through the engine's ``CudaPath`` so that a CUDA transfer takes the same store dispatch as a
  CPU one -- and the same fallback when the region is full (``stores/fallback.py``).

Copies, where they run (the loop's thread or several worker threads) and what each thread
keeps of the flush and invalidate rules, are the copy back-end's: ``stores/cpucopy.py``.

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

Staged large puts. A put of many new blocks reserves them all before its copy starts, and
reservation is per-block work on the loop's thread (slots, index entries, bookkeeping: ~1.2 µs a
block on the H200 host, 4.8 ms of a 16 ms 256 MiB put, while the copy workers sat idle). A put
of at least ``STAGE_MIN_BLOCKS`` blocks and ``STAGE_MIN_BYTES``, with copy threads to spare, is
therefore cut into stages of ``STAGE_BLOCKS`` keys (``_put_staged``): stage k+1 is reserved on
the loop while the copy threads copy stage k (the loop copies no share of those copies, only of
the last), so the put costs about the first stage's reservation plus the copies, not their sum.
Each stage is one ``reserve`` -- under the lock only when the free lists run short, as for any
put. Every stage is published after the last copy, in order: as before, no block of the put
becomes READY before all are in memory, and a failure in any stage (RegionFull, a lock timeout,
a copy error, cancellation) waits for the copy in flight and abandons every stage reserved so
far -- nothing is stored, as for an unstaged put. A key given twice in one put may then be
copied twice into its one reservation (once per stage that holds it; the second copy wins where
an unstaged put keeps the first): a key names its content, so both copies are the same bytes.

Fenced copies. A put's payload copy is a store into slots of this node's chunks, guarded by
the reservation made before it. A node paused between the two (issue 36: SIGSTOP at
``reserve.indexed``) can be judged dead meanwhile: its entries are dropped, its chunks
reclaimed, and another node may claim them and write its own blocks there. Resumed, the copy
would overwrite that node's bytes (the paused-fencing test showed 4 of the other node's blocks
changed). So each copy -- the unstaged one, each stage's, the CUDA DMA's enqueue -- is preceded
by ``Allocator.check_not_fenced`` (one fresh load; NodeEvicted, and the put abandons its
reservations), as the fused put checks inside its kernel. What stays is the window between
that load and the end of the copy: a node paused inside it lands the rest of the copy late
(the residual window of ``sync/slots.py``, bounded by one copy instead of one put).
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Callable

import numpy as np

import tract_kernels as K

from .. import arrays
from ..config import EngineConfig
from ..host.gcpause import PAUSE_MIN_BLOCKS, gc_paused
from ..region import Region
from ..region import index as ix
from ..region.index import SNAP_POFF
from ..region.alloc import Allocator
from ..sync.lock import GlobalLock
from ..sync.settle import settled
from . import plan as kvplan
from .blocks import BlockLifecycle
from .stats import StoreStats
from .txn import PutTxn, ReadTxn, publish_stages
from .cpucopy import CpuCopier
from . import routing as R
from .phases import PhaseTimes
from .parallel import ParallelReads
from .small import SmallPath

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
        self.copier = CpuCopier(region, copy_threads=cfg.copy_threads,
                                read_ahead=cfg.copy_read_ahead)
        """The CPU copy back-end (``stores/cpucopy.py``)."""
        self._tmpls: dict[int, np.ndarray] = {}
        self.yield_to_lock = True
        """Yield one loop turn before a transfer while a task of this process waits for or
        holds the global lock ("Yielding to this node's lock"). Off only in the negative
        control of the test that shows why."""
        self.small = SmallPath(self)
        """The Engine's one-block fast path over this store (``stores/small.py``)."""
        self.parallel = ParallelReads(self)
        """Large reads in parallel groups, metadata included (``stores/parallel.py``)."""

    def _fusable(self, n: int, layer: int | None) -> bool:
        """A transfer the fused kernels take (``routing.fusable``)."""
        return R.fusable(self.layout, n, layer)

    def template(self, n: int) -> np.ndarray:
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

    # -- CPU copy back-end (stores/cpucopy.py) ------------------------------------------------
    @property
    def phases(self) -> PhaseTimes | None:
        """Per-phase timings for benchmarks (``stores/phases.py``); None: not measured."""
        return self.copier.phases

    @phases.setter
    def phases(self, ph: PhaseTimes | None) -> None:
        self.copier.phases = ph

    @property
    def copy_threads(self) -> int:
        """The most threads one copy runs on (``cfg.copy_threads``, None resolved from the host)."""
        return self.copier.copy_threads

    async def copy_in(self, plan: np.ndarray, src_addr: int, nbytes: int) -> None:
        """``CpuCopier.copy_in`` (the CUDA pinned fallback uses it too)."""
        await self.copier.copy_in(plan, src_addr, nbytes)

    async def copy_out(self, plan: np.ndarray, dst_addr: int, nbytes: int) -> None:
        """``CpuCopier.copy_out`` (the CUDA pinned fallback uses it too)."""
        await self.copier.copy_out(plan, dst_addr, nbytes)

    def shutdown_copies(self) -> None:
        """Stop the copy threads. Idempotent."""
        self.copier.shutdown()

    def start_waking(self) -> None:
        """Put this node's doorbell on the running loop (``stores/doorbell.py``)."""
        self.blocks.doorbell.start()

    def stop_waking(self) -> None:
        """Take the doorbell off the loop; later waits poll. Idempotent."""
        self.blocks.doorbell.stop()

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
        t0 = time.perf_counter_ns() if ph is not None else 0
        n = len(keys)
        if self._fusable(n, layer):
            txn = PutTxn(b, keys, layer, timeout, "fused", phases=ph)
            done = self._timed_fused(txn, arrays.data_ptr(kv), self.template(n))
            if done is not None:
                return done
        else:
            txn = PutTxn(b, keys, layer, timeout,
                         "staged" if self._stageable(n, layer) else "cpu", phases=ph)
        # a later layer of blocks this node is filling needs neither the index, nor the lock,
        # nor the key words
        if txn.resume():
            if ph is not None:
                ph.add("reserve_incl_lock", t0)
        else:
            if self._stageable(n, layer):
                return await self._put_staged(txn, kv)
            if not await txn.begin():
                return 0
        plan = kvplan.plan(self.layout, txn.offsets(), txn.positions(), n, layer)
        nbytes = plan.shape[0] * self.layout.half_layer_bytes     # every row is one half-layer
        try:
            b.alloc.check_not_fenced()      # "Fenced copies" (module docstring)
            await self.copy_in(plan, arrays.data_ptr(kv), nbytes)
        except BaseException:
            await txn.abandon()
            raise
        if ph is not None:
            ph.stamp("publish")
        t0 = time.perf_counter_ns() if ph is not None else 0
        done = txn.publish(nbytes)
        if ph is not None:
            ph.add("publish", t0)
        return done

    def put_fused(self, txn: PutTxn, src: int, tmpl: np.ndarray) -> int | None:
        """A fused put (``PutTxn.fused``) of the Engine's one-block fast path
        (``stores/small.py``, which opens ``txn``), timed as ``_timed_fused``."""
        return txn.fused(src, tmpl) if self.phases is None else self._timed_fused(txn, src, tmpl)

    def _timed_fused(self, txn: PutTxn, src: int, tmpl: np.ndarray) -> int | None:
        """``txn.fused``, timed while phases are on: the ``fused`` phase, and the ``publish``
        stamp on return (the kernel ended with the publish)."""
        ph = self.phases
        t0 = time.perf_counter_ns() if ph is not None else 0
        done = txn.fused(src, tmpl)
        if done is not None and ph is not None:
            ph.add("fused", t0)
            ph.stamp("publish")
        return done

    def _stageable(self, n: int, layer: int | None) -> bool:
        """A put of ``n`` new blocks that ``_put_staged`` takes (``routing.stageable``)."""
        return R.stageable(self.layout, n, layer, self.copier.copy_threads)

    async def _put_staged(self, txn: PutTxn, kv: Any) -> int:
        """A large put in stages of ``STAGE_BLOCKS`` keys, the reservation of each stage
        overlapping the copy of the one before (module docstring, "Staged large puts"): one
        transaction per stage, each under the put's deadline."""
        b, ph = self.blocks, self.phases
        keys, layer = txn.keys, txn.layer
        words = txn.key_words()
        n = len(keys)
        src = arrays.data_ptr(kv)
        half = self.layout.half_layer_bytes
        stages: list[tuple[PutTxn, int]] = []
        copy: asyncio.Future[None] | None = None
        t_all = time.perf_counter_ns() if ph is not None else 0
        b.preclaimer.note_put(n)          # the pre-claim task keeps room for the whole put, not a stage
        try:
            step = R.STAGE_BLOCKS
            for s0 in range(0, n, step):
                s1 = min(n, s0 + step)
                st = PutTxn(b, keys[s0:s1], layer, txn.left(), "stage",
                            words=words[s0:s1], phases=ph)
                if not await st.begin(count_empty=False):
                    continue
                plan = kvplan.plan(self.layout, st.offsets(), st.positions() + s0, n, layer)
                nbytes = plan.shape[0] * half           # every row is one half-layer
                stages.append((st, nbytes))
                if copy is not None:
                    await copy                  # the copy threads take one stage at a time
                b.alloc.check_not_fenced()      # "Fenced copies" (module docstring)
                copy = asyncio.ensure_future(
                    self.copier.copy_in(plan, src, nbytes, loop_share=s1 >= n))
                if s1 < n:
                    # one loop turn: the task's first step hands the copy to the threads (a
                    # lock-free reservation of the next stage never suspends, and without this
                    # the copy would start only at the ``await`` below: no overlap at all)
                    await asyncio.sleep(0)
            if copy is not None:
                await copy
        except BaseException:
            if copy is not None:
                await _settled(copy)            # no byte may still land (docs/design.md inv. 7)
            for st, _ in stages:
                await st.abandon()
            raise
        if not stages:
            b.stats.puts += 1
            return 0
        if ph is not None:
            ph.add("staged", t_all)
            ph.stamp("publish")
        t0 = time.perf_counter_ns() if ph is not None else 0
        done = publish_stages(stages)
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
        txn: ReadTxn | None = None
        if self._fusable(n, layer):
            txn = ReadTxn(b, keys, layer, timeout, "fused")
            if await txn.fused_waiting(arrays.data_ptr(out), self.template(n)):
                if ph is not None:
                    ph.add("fused", t0)
                await txn.consume()
                return out
        par = False
        if txn is None:
            par = self.parallel.takes(n, layer)
            txn = ReadTxn(b, keys, layer, timeout, "parallel" if par else "cpu")
        with b.preclaimer.reading():           # no evicting ahead meanwhile (PreClaimer.busy)
            if par:
                txn.key_words()
                snap = await self.parallel.get(txn, out, layer, txn.left())
                if snap is not None:
                    txn.took(snap)
                    await txn.consume()
                    return out
            snap = await txn.prepare()
            if ph is not None:
                ph.add("prepare_read", t0)
            if b.pause_after_snapshot is not None:
                await b.pause_after_snapshot()
            plan = kvplan.plan(self.layout, snap[:, SNAP_POFF], np.arange(n), n, layer)
            nbytes = plan.shape[0] * self.layout.half_layer_bytes   # every row: a half-layer
            await self.copy_out(plan, arrays.data_ptr(out), nbytes)
            t0 = time.perf_counter_ns() if ph is not None else 0
            txn.validate(nbytes)
            if ph is not None:
                ph.add("validate", t0)
        await txn.consume()
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


async def _settled(fut: asyncio.Future[None]) -> None:
    """Wait until ``fut`` is done, through cancellations of the caller (it is a copy whose
    threads cannot be interrupted); its own outcome is retrieved and dropped (the caller is
    already raising)."""
    await settled(fut)
    if not fut.cancelled():
        fut.exception()
