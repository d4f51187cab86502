"""The region store: put, get and lookup of KV blocks in the shared region, for one node.

The lifecycle of every block (reserve, publish, validate a read, touch, abandon) belongs to
``BlockLifecycle`` (``stores/blocks.py``); this module holds the two copy back-ends beneath it
and picks one per transfer by the tensor's device:

* CPU tensors: the jitted copies of ``region/index.py`` -- inline on the event loop when small
  (a thread hop costs ~50-100 µs), in a worker thread when large, and for large reads on two
  threads (one drops the payload lines ahead, the other copies behind);
* CUDA tensors: the DMA path of ``cuda/store.py`` (the region registered with CUDA), reached
  through the engine's ``CudaPath`` so that a CUDA transfer takes the same store dispatch as a
  CPU one -- and the same fallback when the region is full (``stores/fallback.py``).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import numpy as np
import torch

import tract_kernels as K

from ..config import EngineConfig
from ..gcpause import PAUSE_MIN_BLOCKS, gc_paused
from ..keys import keys_to_words
from ..region import Region
from ..region import index as ix
from ..region.alloc import Allocator
from ..sync.lock import GlobalLock
from . import plan as kvplan
from . import waits
from .blocks import BlockLifecycle, StoreStats
from .phases import PhaseTimes

INLINE_COPY_BYTES = 1 << 20
"""Copies up to this size run on the event loop (a thread hop costs ~50-100 µs here)."""

NT_READ_BYTES = 8 << 20
"""Gets at least this large write their output with non-temporal stores (``read_rows``)."""


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
    async def _copy(self, fn: Any, plan: np.ndarray, base: int, nbytes: int) -> None:
        ph = self.phases
        t0 = time.perf_counter_ns() if ph is not None else 0
        if nbytes <= INLINE_COPY_BYTES:
            fn(self.mem, plan, base)
            if ph is not None:
                ph.add("copy_call", t0)
                ph.add("copy_kernel", t0)
            return
        if ph is not None:
            fn = _timed(fn, ph)
        # A copy in a thread cannot be interrupted: shield it so that a cancelled caller still
        # waits for the last byte before anything is freed (DESIGN.md invariant 7).
        # the worker thread's own view (``Region.mem``; the sim's caches are per thread)
        fut = asyncio.get_running_loop().run_in_executor(
            None, waits.resolve_thread_mem, fn, waits.ThreadMem(self.region), plan, base)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise
        if ph is not None:
            ph.add("copy_call", t0)

    async def copy_in(self, plan: np.ndarray, src_addr: int, nbytes: int) -> None:
        """Copy private bytes at ``src_addr`` into the region by plan rows (region offset,
        source offset, nbytes); in memory on return (the CUDA pinned fallback uses it too)."""
        await self._copy(ix.copy_in, plan, src_addr, nbytes)

    async def copy_out(self, plan: np.ndarray, dst_addr: int, nbytes: int) -> None:
        """Copy region bytes to private memory at ``dst_addr`` by plan rows."""
        if (nbytes >= NT_READ_BYTES and self.cfg.copy_threads >= 2
                and self.mem.backend == K.BACKEND_HW):
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
        behind it (``K.drop_rows_ahead``; 256 MiB: 13.0-13.8 -> 11.5-11.8 ms on this VM).
        Returns once both threads are done, also when cancelled or when one of them raised."""
        ctl = np.zeros(2, dtype=np.uint64)            # progress, abort: alive until both end
        loop = asyncio.get_running_loop()
        tm = waits.ThreadMem(self.region)    # each thread its own view (``Region.mem``)
        ahead = loop.run_in_executor(None, waits.resolve_thread_mem, ix.drop_payload_rows_ahead,
                                     tm, plan, ctl.ctypes.data)
        behind = loop.run_in_executor(None, waits.resolve_thread_mem, ix.copy_out_behind, tm,
                                      plan, np.uint64(dst), ctl.ctypes.data, True)
        try:
            await asyncio.shield(asyncio.wait([ahead, behind]))
        except asyncio.CancelledError:
            await asyncio.wait([ahead, behind])
            raise
        ahead.result()                                # IndexError of a bad row, if any
        if behind.result():
            raise AssertionError("region store: the copying thread stopped before its rows")

    # -- put ----------------------------------------------------------------------------------
    async def put(self, keys: list[bytes], kv: torch.Tensor, layer: int | None,
                  timeout: float | None) -> int:
        """Store blocks not yet present; returns how many this call stored (or filled).
        Raises RegionFull (nothing stored), TransferTimeout, NodeEvicted."""
        if kv.is_cuda:
            return await self._put_cuda(keys, kv, layer, timeout)
        if len(keys) < PAUSE_MIN_BLOCKS:     # skip the context manager (~1 µs) when it is a no-op
            return await self._put(keys, kv, layer, timeout)
        with gc_paused(len(keys)):
            return await self._put(keys, kv, layer, timeout)

    async def _put(self, keys: list[bytes], kv: torch.Tensor, layer: int | None,
                   timeout: float | None) -> int:
        b, ph = self.blocks, self.phases
        kv = kv.contiguous()
        words = keys_to_words(keys)
        t0 = time.perf_counter_ns() if ph is not None else 0
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
        poffs = np.fromiter((r.allocation.offset_bytes for r in res), dtype=np.int64,
                            count=len(res))
        plan = kvplan.plan(self.layout, poffs, np.array(todo), len(keys), layer)
        nbytes = plan.shape[0] * self.layout.half_layer_bytes     # every row is one half-layer
        try:
            await self.copy_in(plan, kv.data_ptr(), nbytes)
        except BaseException:
            await b.abandon([keys[i] for i in todo])
            raise
        t0 = time.perf_counter_ns() if ph is not None else 0
        done = b.publish(keys, todo, res, layer, nbytes)
        if ph is not None:
            ph.add("publish", t0)
        return done

    async def _put_cuda(self, keys: list[bytes], kv: torch.Tensor, layer: int | None,
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
    async def get(self, keys: list[bytes], out: torch.Tensor, layer: int | None,
                  timeout: float | None) -> torch.Tensor:
        """Read ``keys`` into ``out`` (CPU or CUDA). Raises BlockNotFound, LayerNotReady,
        TransferTimeout, BlockEvicted."""
        if out.is_cuda:
            return await self._get_cuda(keys, out, layer, timeout)
        if len(keys) < PAUSE_MIN_BLOCKS:     # as in put
            return await self._get(keys, out, layer, timeout)
        with gc_paused(len(keys)):
            return await self._get(keys, out, layer, timeout)

    async def _get(self, keys: list[bytes], out: torch.Tensor, layer: int | None,
                   timeout: float | None) -> torch.Tensor:
        b, ph = self.blocks, self.phases
        n = len(keys)
        t0 = time.perf_counter_ns() if ph is not None else 0
        words, snap = await b.prepare_read(keys, layer, timeout)
        if ph is not None:
            ph.add("prepare_read", t0)
        if b.pause_after_snapshot is not None:
            await b.pause_after_snapshot()
        plan = kvplan.plan(self.layout, snap[:, 3], np.arange(n), n, layer)
        nbytes = plan.shape[0] * self.layout.half_layer_bytes     # every row is one half-layer
        await self.copy_out(plan, out.data_ptr(), nbytes)
        t0 = time.perf_counter_ns() if ph is not None else 0
        b.validate_read(keys, words, snap, nbytes)
        if ph is not None:
            ph.add("validate", t0)
        await b.consume(keys, words, snap, layer)
        return out

    async def _get_cuda(self, keys: list[bytes], out: torch.Tensor, layer: int | None,
                        timeout: float | None) -> torch.Tensor:
        from ..cuda import store as cs
        if self._cuda_path is None:
            raise AssertionError("region store: a CUDA tensor reached a store built without "
                                 "the engine's CUDA path")
        cpath = self._cuda_path()
        fut = await cs.start_get(self, cpath, keys, [out],
                                 cs.contiguous_plan_fn(self.layout, len(keys), layer), layer,
                                 timeout, result=out, after=torch.cuda.current_stream(out.device))
        return await cs.finish_get(self, cpath, keys, fut, layer)

    # -- maintenance --------------------------------------------------------------------------
    async def maintain(self, timeout: float) -> None:
        await self.blocks.maintain(timeout)

    def on_reclaim(self, node_id: int, spans: list[tuple[int, int]]) -> None:
        self.blocks.on_reclaim(node_id, spans)

    async def close(self, timeout: float) -> None:
        await self.blocks.close(timeout)


def _timed(fn: Any, ph: PhaseTimes) -> Any:
    """``fn`` that adds its own run time to ``copy_kernel`` (for copies in a worker thread)."""
    def run(*args: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            ph.add("copy_kernel", t0)
    return run
