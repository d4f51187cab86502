"""The region path of the Engine: put, get and lookup of KV blocks through the prefix index.

This is the asyncio layer over the lock-free substrate (``region.index``, ``region.alloc``,
``sync.lock``): it decides *when* to take the global lock (once per put batch, and for
maintenance), *where* copies run (inline when small, in a worker thread when large), and how
waits for layers still being produced are done (``waits``). The byte-level protocol lives in
``region/index.py``; read its docstring first.

Block lifetime. A block lives in a slot of its producer's heap. It is READY until evicted (LRU
under memory pressure), consumed (transfer-only mode), expired (transfer-only deadline), or
reclaimed with its owner's chunks when the owner node dies or leaves. A put that fails or is
cancelled after reserving evicts its own entries (after its copies have finished: no write ever
lands in a slot that was handed out again).
"""
from __future__ import annotations

import asyncio
import itertools
import dataclasses
import time
from typing import Any

import numpy as np
import torch

import tract_kernels as K

from . import kvplan, waits
from .gcpause import PAUSE_MIN_BLOCKS, gc_paused
from .config import EngineConfig
from .errors import (BlockEvicted, BlockNotFound, LayerNotReady, RegionFull, TransferTimeout)
from .keys import keys_to_words
from .region import Region
from .region import index as ix
from .region.alloc import Allocation, Allocator
from .region.chunks import alloc_geometry
from .store_stats import TransferStats

INLINE_COPY_BYTES = 1 << 20
"""Copies up to this size run on the event loop (a thread hop costs ~50-100 µs here)."""

VICTIM_SAMPLE = 16

SMALL_READ = 8
"""Transfers of at most this many blocks take the Python-int paths (a get checks its snapshot
after ``tolist``, a put splits its snapshot and builds its allocation rows in plain loops):
each numpy operation costs ~1 µs whatever its size, more than the loop for a few blocks."""

NT_READ_BYTES = 8 << 20
"""Gets at least this large write their output with non-temporal stores (``read_rows``)."""


_A_OFFSET, _A_NBYTES, _A_OWNER, _A_GEN, _A_TOKEN = (
    Allocation._fields.index(f) for f in ("offset_bytes", "nbytes", "owner_node", "generation",
                                          "token"))
"""Columns of a batch of allocations flattened into one int64 array (``np.fromiter`` over
the chained tuples: 0.5 ms for 4096 of them, ``np.array`` 1.2 ms, a tuple per row 2 ms)."""


class _Reservation:
    """A block this node reserved and is filling, layer by layer. (A slotted class: one is made
    per block of every put, under the global lock.)"""
    __slots__ = ("slot", "version", "allocation", "layers_lo", "layers_hi")

    def __init__(self, slot: int, version: int, allocation: Allocation) -> None:
        self.slot = slot
        self.version = version
        self.allocation = allocation
        self.layers_lo = 0
        self.layers_hi = 0


@dataclasses.dataclass
class StoreStats(TransferStats):
    """The region store's counters: the shared ones plus recovery and global-lock figures."""
    reclaimed_entries: int = 0
    full_without_chunk: int = 0
    """Puts refused at once: no chunk of this node's to make room in, none free to claim."""
    lock_acquisitions: int = 0
    lock_wait_s: float = 0.0


class RegionStore:
    """put / get / lookup over one region for one node. Created and owned by the Engine."""

    def __init__(self, cfg: EngineConfig, region: Region, lock: Any, allocator: Allocator,
                 index: ix.PrefixIndex) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.region = region
        self.lock = lock
        self.alloc = allocator
        self.index = index
        self.geo = index.geo
        self.ageo = alloc_geometry(region)
        self.node_id = cfg.node_id
        self.stats = StoreStats()
        self._reserved: dict[bytes, _Reservation] = {}
        self._touches: dict[int, int] = {}            # slot -> version, flushed under the lock
        self._consumed_layers: dict[bytes, int] = {}  # transfer mode: layers read so far
        self._pause_after_snapshot: Any = None
        """Test seam: an awaitable factory run between a read's snapshot and its copy, so a
        test can evict and rewrite the block exactly there (deterministic torn-read control)."""
        self.validate_reads = True
        """Re-validate versions after each copy (invariant 6). Only the torn-read stress test's
        negative control turns this off, to show that without it wrong bytes get through."""
        lo, hi = kvplan.layer_mask(self.layout, None)
        self._all_lo, self._all_hi = lo, hi

    # -- helpers ------------------------------------------------------------------------------
    @property
    def mem(self) -> K.Mem:
        return self.region.mem

    def _allocation_of(self, poff: int, pnb: int, owner_word: int, token: int) -> Allocation:
        g = self.ageo
        chunk = (poff - g.chunks_offset) // g.chunk_bytes
        slot_bytes = self.alloc.class_for(pnb)
        slot = (poff - g.chunk_off(chunk)) // slot_bytes
        return Allocation(offset_bytes=poff, nbytes=pnb, slot_bytes=slot_bytes,
                          owner_node=owner_word & 0xFFFF, chunk_index=chunk, slot_index=slot,
                          generation=owner_word >> 16, token=token)

    def _payload_ok(self, poff: int, pnb: int) -> bool:
        g = self.ageo
        end = g.chunks_offset + g.nchunks * g.chunk_bytes
        return pnb == self.layout.block_bytes and g.chunks_offset <= poff and poff + pnb <= end

    async def _locked(self, timeout: float | None):  # noqa: ANN202
        t0 = time.perf_counter()
        try:
            await self.lock.acquire(timeout=timeout)
        except Exception as e:
            if type(e).__name__ == "LockTimeout":
                raise TransferTimeout(f"global lock not granted within {timeout} s "
                                      f"({self.lock.statistics()})") from e
            raise
        self.stats.lock_acquisitions += 1
        self.stats.lock_wait_s += time.perf_counter() - t0

    async def _copy(self, fn, plan: np.ndarray, base: int, nbytes: int) -> None:  # noqa: ANN001
        if nbytes <= INLINE_COPY_BYTES:
            fn(self.mem, plan, base)
            return
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

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        return self.index.lookup(keys_to_words(keys))

    # -- put ----------------------------------------------------------------------------------
    async def put(self, keys: list[bytes], kv: torch.Tensor, layer: int | None,
                  timeout: float | None) -> int:
        """Store blocks not yet present; returns how many this call stored (or filled)."""
        if len(keys) < PAUSE_MIN_BLOCKS:     # skip the context manager (~1 µs) when it is a no-op
            return await self._put(keys, kv, layer, timeout)
        with gc_paused(len(keys)):
            return await self._put(keys, kv, layer, timeout)

    async def _put(self, keys: list[bytes], kv: torch.Tensor, layer: int | None,
                   timeout: float | None) -> int:
        n = len(keys)
        kv = kv.contiguous()
        words = keys_to_words(keys)
        snap = self.index.snapshot(words)
        todo = await self.reserve_missing(keys, words, snap, timeout)
        if not todo:
            self.stats.puts += 1
            return 0
        res = [self._reserved[keys[i]] for i in todo]
        poffs = np.array([r.allocation.offset_bytes for r in res], dtype=np.int64)
        plan = kvplan.plan(self.layout, poffs, np.array(todo), n, layer)
        nbytes = plan.shape[0] * self.layout.half_layer_bytes     # every row is one half-layer
        try:
            await self._copy(ix.copy_in, plan, kv.data_ptr(), nbytes)
        except BaseException:
            await self._abandon([keys[i] for i in todo])
            raise
        lo, hi = kvplan.layer_mask(self.layout, layer)
        slots = np.array([r.slot for r in res], dtype=np.int64)
        ix.publish_layers(self.mem, self.geo.entries_offset, slots, lo, hi, self._all_lo,
                          self._all_hi)
        reserved = self._reserved
        if layer is None:             # every layer written: all of them are READY now
            for i in todo:
                del reserved[keys[i]]
            self.stats.blocks_stored += len(todo)
        else:
            for i, r in zip(todo, res):
                r.layers_lo |= lo
                r.layers_hi |= hi
                if r.layers_lo == self._all_lo and r.layers_hi == self._all_hi:
                    del reserved[keys[i]]
                    self.stats.blocks_stored += 1
        self.stats.puts += 1
        self.stats.bytes_put += nbytes
        return len(todo)

    async def reserve_missing(self, keys: list[bytes], words: np.ndarray, snap: np.ndarray,
                              timeout: float | None) -> list[int]:
        """The positions of ``keys`` a put writes, ascending: blocks this node is already
        filling (an earlier layer's put), plus those absent from the index, reserved now under
        one hold of the global lock. Present blocks (anyone's) are skipped and counted."""
        todo: list[int] = []          # positions in keys this call writes
        new: list[int] = []           # positions that need a reservation
        reserved = self._reserved
        if not reserved and len(keys) > SMALL_READ:    # none of ours in flight: one numpy pass
            present = snap[:, 0] >= 0
            self.stats.blocks_skipped += int(present.sum())
            new = np.flatnonzero(~present).tolist()
        else:
            for i, k in enumerate(keys):
                if k in reserved:
                    todo.append(i)
                elif snap[i, 0] >= 0:
                    self.stats.blocks_skipped += 1   # present, or produced by another node
                else:
                    new.append(i)
        if new:
            await self._reserve(keys, words, new, timeout)
            got = [i for i in new if keys[i] in reserved]
            todo = sorted(set(todo).union(got)) if todo else got
        return todo

    async def _reserve(self, keys: list[bytes], words: np.ndarray, positions: list[int],
                       timeout: float | None) -> None:
        """Reserve entries and payload for ``positions`` under one hold of the global lock."""
        await self._locked(timeout)
        mine: list[tuple[bytes, int]] = []
        try:
            self.lock.check_token()
            self._flush_touches_locked()
            now = time.time_ns()
            transfer = self.cfg.mode == "transfer"
            flags = ix.FLAG_TRANSFER if transfer else 0
            deadline = now + int(self.cfg.transfer_deadline_s * 1e9) if transfer else 0
            producer = self.node_id  # the epoch lives in the node table; the id suffices here
            allocs = self._alloc_many_locked(len(positions))
            res = np.zeros((len(positions), 3), dtype=np.int64)
            if len(allocs) <= SMALL_READ:       # a few: tuples beat five numpy operations
                ainfo = np.array([(a.offset_bytes, a.nbytes, a.owner_node | (a.generation << 16),
                                   a.token) for a in allocs], dtype=np.uint64).reshape(-1, 4)
            else:
                a = np.fromiter(itertools.chain.from_iterable(allocs), dtype=np.int64,
                                count=len(allocs) * len(Allocation._fields)
                                ).reshape(-1, len(Allocation._fields))
                ainfo = np.empty((len(allocs), 4), dtype=np.uint64)
                ainfo[:, 0] = a[:, _A_OFFSET]
                ainfo[:, 1] = a[:, _A_NBYTES]
                ainfo[:, 2] = a[:, _A_OWNER] | (a[:, _A_GEN] << 16)
                ainfo[:, 3] = a[:, _A_TOKEN]
            try:
                # one kernel call: the reservation, then (all reserved) the publishes counter
                counted = ix.reserve_batch_counted(
                    self.mem, self.geo.header_offset, self.geo.entries_offset, self.index.mask,
                    self.geo.max_probe, words if len(positions) == len(keys) else
                    words[np.asarray(positions, dtype=np.int64)], ainfo, now, producer, flags,
                    deadline, res)
            except BaseException:
                self.alloc.free_many(allocs)
                raise
            full = False
            unused: list[Allocation] = []
            reserved = self._reserved
            if len(positions) > SMALL_READ and (res[:, 0] >= 0).all():  # all reserved: C loops
                ks = [keys[i] for i in positions]
                reserved.update(zip(ks, map(_Reservation, res[:, 0].tolist(),
                                            res[:, 2].tolist(), allocs)))
                mine = list(zip(ks, res[:, 1].tolist()))
            for j, (slot, prev, version) in enumerate(res.tolist() if not mine else ()):
                i = positions[j]
                if slot >= 0:
                    reserved[keys[i]] = _Reservation(slot, version, allocs[j])
                    mine.append((keys[i], prev))
                    continue
                unused.append(allocs[j])
                if slot == -1:
                    full = True
                else:                               # another node reserved it since our snapshot
                    self.stats.blocks_skipped += 1
            if unused:
                self.alloc.free_many(unused)
            if full:
                raise RegionFull(f"index probe window of {self.geo.max_probe} entries is full "
                                 f"(capacity {self.geo.capacity}); create the region with a "
                                 f"larger index (EngineConfig.index_capacity)")
            if not counted:
                self.index.bump_counter_locked(ix.H_PUBLISHES, len(mine))
        except BaseException:
            # all or nothing: a batch that cannot be placed whole leaves the region as it was
            # (a slot that was EMPTY goes back to EMPTY: no probe chain can run through it yet)
            for state in (ix.EMPTY, ix.TOMBSTONE):
                back = [self._reserved.pop(k).slot for k, prev in reversed(mine) if prev == state]
                self._evict_many_locked(back, count=False, new_state=state)
            raise
        finally:
            self.lock.release()

    def _alloc_many_locked(self, count: int) -> list[Allocation]:
        """``count`` block slots, evicting LRU blocks while the region is full. Raises RegionFull."""
        nbytes = self.layout.block_bytes
        out: list[Allocation] = []
        evicted = 0
        try:
            while len(out) < count:
                out += self.alloc.alloc_many_locked(nbytes, count - len(out), self.lock,
                                                    partial=True)
                if len(out) >= count:
                    break
                if not out and not self.alloc.holds_class(nbytes):
                    # No chunk of ours to free slots in, and none free to claim: evicting
                    # would only hand other nodes' slots back to them and empty everyone's
                    # cache for nothing (a node that joined a full region evicted ~20 000
                    # blocks in a 30 s stress and starved the other nodes' reads too)
                    self.stats.full_without_chunk += 1
                    raise RegionFull(f"node {self.node_id} holds no chunk of "
                                     f"{self.alloc.class_for(nbytes)}-byte slots and the region "
                                     f"has none free: blocks live in their producer's chunks "
                                     f"(chunks are not rebalanced between nodes), so evicting "
                                     f"other nodes' blocks would not make room here")
                budget = 64 + 2 * count - evicted
                got = self._evict_lru_locked(min(count - len(out), budget)) if budget > 0 else 0
                if got == 0:
                    g = self.ageo
                    most = g.nchunks * (g.chunk_bytes // self.alloc.class_for(nbytes))
                    if count > most:   # no eviction could ever make room: say the real limit
                        raise RegionFull(
                            f"a put of {count} new {nbytes}-byte blocks is larger than the whole "
                            f"region: {self.region.path} ({self.region.size_bytes} bytes) holds "
                            f"at most {most} of them ({g.nchunks} chunks of "
                            f"{g.chunk_bytes} bytes); put at most {most} blocks at a "
                            f"time, or create a larger region (EngineConfig.region_bytes)")
                    live = self.region.nodes.live_ids(timeout_s=self.cfg.liveness_timeout_s)
                    others = [i for i in live if i != self.node_id]
                    raise RegionFull(
                        f"no space for {count - len(out)} more {nbytes}-byte blocks after "
                        f"{evicted} evictions, and no other block could be evicted (blocks "
                        f"still being written, and transfer-only blocks not yet consumed, are "
                        f"not evictable)" +
                        (f"; slots that nodes {others} free return to their chunks "
                         f"asynchronously" if others else ""))
                evicted += got
                self.alloc.drain_returns()
        except BaseException:
            self.alloc.free_many(out)
            raise
        return out

    def _evict_lru_locked(self, k: int) -> int:
        """Evict up to ``k`` sampled-LRU victims and free their payloads; how many."""
        info = np.zeros((k, 5), dtype=np.int64)
        n = int(ix.evict_lru_batch(self.mem, self.geo.header_offset, self.geo.entries_offset,
                                   self.geo.capacity, VICTIM_SAMPLE, time.time_ns(), k, info))
        if n:
            self._free_payloads(info[:n, 1:])
            self.index.bump_counter_locked(ix.H_EVICTIONS, n)
            self.stats.evictions += n
            self.stats.evictions_for_space += n
        return n

    def _evict_locked(self, slot: int, *, count: bool = True, new_state: int = ix.TOMBSTONE) -> None:
        self._evict_many_locked([slot], count=count, new_state=new_state)

    def _evict_many_locked(self, slots: list[int], *, count: bool = True,
                           new_state: int = ix.TOMBSTONE) -> None:
        """Tombstone entries (``new_state``), then free their payloads, as one batch."""
        if not slots:
            return
        info = np.zeros((len(slots), 4), dtype=np.int64)
        ix.evict_batch(self.mem, self.geo.entries_offset, self.index.mask,
                       np.asarray(slots, dtype=np.int64), new_state, info)
        if count:
            self.index.bump_counter_locked(ix.H_EVICTIONS, len(slots))
            self.stats.evictions += len(slots)
        self._free_payloads(info)

    def _free_payloads(self, info: np.ndarray) -> None:
        """Free the payload slots of evicted entries: rows (offset, nbytes, owner word, token)."""
        allocs = [self._allocation_of(poff, pnb, owner, token)
                  for poff, pnb, owner, token in info.tolist() if self._payload_ok(poff, pnb)]
        self.alloc.free_many(allocs)

    async def _abandon(self, keys: list[bytes]) -> None:
        """Evict this node's unfinished reservations (after a failed or cancelled put)."""
        mine = [(k, self._reserved.pop(k)) for k in keys if k in self._reserved]
        if not mine:
            return
        await asyncio.shield(self._abandon_locked(mine))

    async def _abandon_locked(self, mine: list[tuple[bytes, _Reservation]]) -> None:
        await self._locked(timeout=max(5.0, self.cfg.liveness_timeout_s * 4))
        try:
            self._evict_many_locked([r.slot for _, r in mine])
        finally:
            self.lock.release()

    # -- get ----------------------------------------------------------------------------------
    async def prepare_read(self, keys: list[bytes], layer: int | None,
                           timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-2 of a lock-free read (index.py): snapshot the entries (waiting up to
        ``timeout`` for blocks or the layer), check state and payload bounds. Returns the key
        words and the snapshot. Shared by the CPU and CUDA gets. Raises BlockNotFound,
        LayerNotReady, TransferTimeout, BlockEvicted."""
        words = keys_to_words(keys)
        snap = self.index.snapshot(words)
        if timeout is not None and timeout > 0:
            snap = await self._wait_ready(words, snap, layer, timeout)
        g = self.ageo
        end = g.chunks_offset + g.nchunks * g.chunk_bytes
        if snap.shape[0] <= SMALL_READ:
            # a few blocks: the same checks on Python ints (each numpy op below costs ~1 µs)
            rows = snap.tolist()
            bb, lo = self.layout.block_bytes, g.chunks_offset
            if all(r[0] >= 0 and r[2] == ix.READY for r in rows):
                for i, r in enumerate(rows):
                    if r[4] != bb or r[3] < lo or r[3] + r[4] > end:
                        self.stats.validation_failures += 1
                        raise BlockEvicted(f"block {i} ({keys[i][:8].hex()}…) has payload "
                                           f"bounds [{r[3]}, +{r[4]}) that do not fit this "
                                           f"layout: changed during the read; treat as a miss")
                return words, snap
        self._check_available(keys, snap, layer)
        bad = np.flatnonzero((snap[:, 4] != self.layout.block_bytes) | (snap[:, 3] < g.chunks_offset)
                             | (snap[:, 3] + snap[:, 4] > end))
        if bad.size:
            i = int(bad[0])
            self.stats.validation_failures += 1
            raise BlockEvicted(f"block {i} ({keys[i][:8].hex()}…) has payload bounds "
                               f"[{snap[i, 3]}, +{snap[i, 4]}) that do not fit this layout: "
                               f"changed during the read; treat as a miss")
        return words, snap

    async def get(self, keys: list[bytes], out: torch.Tensor, layer: int | None,
                  timeout: float | None) -> torch.Tensor:
        if len(keys) < PAUSE_MIN_BLOCKS:     # as in put
            return await self._get(keys, out, layer, timeout)
        with gc_paused(len(keys)):
            return await self._get(keys, out, layer, timeout)

    async def _get(self, keys: list[bytes], out: torch.Tensor, layer: int | None,
                   timeout: float | None) -> torch.Tensor:
        n = len(keys)
        words, snap = await self.prepare_read(keys, layer, timeout)
        slots = snap[:, 0].copy()
        versions = snap[:, 1].copy()
        if self._pause_after_snapshot is not None:
            await self._pause_after_snapshot()
        plan = kvplan.plan(self.layout, snap[:, 3], np.arange(n), n, layer)
        nbytes = plan.shape[0] * self.layout.half_layer_bytes     # every row is one half-layer
        if (nbytes >= NT_READ_BYTES and self.cfg.copy_threads >= 2
                and self.mem.backend == K.BACKEND_HW):
            await self._copy_out_split(plan, out.data_ptr())
        else:
            fn = ix.copy_out_nt if nbytes >= NT_READ_BYTES else ix.copy_out
            await self._copy(fn, plan, out.data_ptr(), nbytes)
        ok = np.ones(n, dtype=np.bool_)
        bad = (ix.revalidate_batch(self.mem, self.geo.entries_offset, slots, versions,
                                   snap[:, 3].copy(), words, ok)
               if self.validate_reads else 0)
        self.stats.gets += 1
        if bad:
            self.stats.validation_failures += 1
            self.stats.misses += int(bad)
            first = int(np.flatnonzero(~ok)[0])
            raise BlockEvicted(f"{bad} of {n} blocks were evicted while being read (first: "
                               f"block {first}, {keys[first][:8].hex()}…); the output is not "
                               f"trusted: treat as a miss")
        self.stats.hits += n
        self.stats.blocks_read += n
        self.stats.bytes_got += nbytes
        for s, v in zip(slots.tolist(), versions.tolist()):
            self._touches[s] = v
        if self.cfg.mode == "transfer" and snap[:, 7].any():
            await self._consume(keys, words, slots, versions, snap[:, 3].copy(), layer)
        return out

    def _check_available(self, keys: list[bytes], snap: np.ndarray, layer: int | None) -> None:
        if bool(((snap[:, 0] >= 0) & (snap[:, 2] == ix.READY)).all()):
            return                                   # the common case, without a Python loop
        for i in range(len(keys)):
            if snap[i, 0] < 0:
                self.stats.misses += 1
                raise BlockNotFound(f"block {i} of {len(keys)} ({keys[i][:8].hex()}…) is not in "
                                    f"the region (never stored, or evicted); lookup() says how "
                                    f"many leading blocks are resident")
            st = snap[i, 2]
            if st == ix.READY:
                continue
            if layer is None:
                raise LayerNotReady(f"block {i} ({keys[i][:8].hex()}…) is still being produced; "
                                    f"pass timeout= to wait for it, or get it layer by layer")
            word, bit = divmod(layer, 64)
            if not (int(snap[i, 5 + word]) >> bit) & 1:
                raise LayerNotReady(f"layer {layer} of block {i} ({keys[i][:8].hex()}…) has not "
                                    f"landed yet; pass timeout= to wait for it")

    async def _wait_ready(self, words: np.ndarray, snap: np.ndarray, layer: int | None,
                          timeout: float) -> np.ndarray:
        """Wait (event-driven poll) until every key is present and has the layer / is READY."""
        deadline = waits.deadline_ns(timeout)
        self.stats.layer_waits += 1
        g = self.geo
        for _ in range(3):  # brief in-loop spin: the common case is "already there"
            if self._satisfied(snap, layer):
                return snap
            await asyncio.sleep(0)
            snap = self.index.snapshot(words)
        stop = np.zeros(1, dtype=np.uint8)
        word, bit = (0, 0) if layer is None else divmod(layer, 64)
        out = np.zeros_like(snap)
        r = await waits.run_poll(waits.poll_ready, waits.ThreadMem(self.region), g.entries_offset,
                                 self.index.mask,
                                 g.max_probe, words, word, np.uint64(1 << bit), layer is None,
                                 deadline, stop, out)
        if r == 0:
            absent = int((out[:, 0] < 0).sum())
            if absent:
                raise TransferTimeout(f"{absent} of {len(words)} blocks did not appear within "
                                      f"{timeout} s")
            raise TransferTimeout(f"{'layer ' + str(layer) if layer is not None else 'blocks'} "
                                  f"not produced within {timeout} s")
        return out          # r == -1: a block vanished; the caller's checks raise BlockNotFound

    @staticmethod
    def _satisfied(snap: np.ndarray, layer: int | None) -> bool:
        if snap.shape[0] <= SMALL_READ and layer is None:     # Python ints: no numpy round
            return all(r[0] >= 0 and r[2] == ix.READY for r in snap.tolist())
        if (snap[:, 0] < 0).any():
            return False
        if layer is None:
            return bool((snap[:, 2] == ix.READY).all())
        word, bit = divmod(layer, 64)
        return bool(((snap[:, 2] == ix.READY) | ((snap[:, 5 + word] >> bit) & 1 == 1)).all())

    async def _consume(self, keys: list[bytes], words: np.ndarray, slots: np.ndarray,
                       versions: np.ndarray, poffs: np.ndarray, layer: int | None) -> None:
        """Transfer-only mode: free blocks once their consumer has read every layer."""
        done = []
        for i, k in enumerate(keys):
            if layer is None:
                done.append(i)
            else:
                seen = self._consumed_layers.get(k, 0) | (1 << layer)
                if seen == (1 << self.layout.num_layers) - 1:
                    self._consumed_layers.pop(k, None)
                    done.append(i)
                else:
                    self._consumed_layers[k] = seen
        if not done:
            return
        await self._locked(timeout=max(5.0, self.cfg.liveness_timeout_s * 4))
        try:
            check = np.zeros(len(done), dtype=np.bool_)
            ix.revalidate_batch(self.mem, self.geo.entries_offset, slots[done], versions[done],
                                poffs[done], words[done], check)
            gone = [int(slots[i]) for j, i in enumerate(done) if check[j]]
            self._evict_many_locked(gone)
            self.stats.consumed += len(gone)
        finally:
            self.lock.release()

    # -- maintenance (under the lock) ---------------------------------------------------------
    def _flush_touches_locked(self) -> None:
        if not self._touches:
            return
        slots = np.fromiter(self._touches.keys(), dtype=np.int64)
        versions = np.fromiter(self._touches.values(), dtype=np.int64)
        self._touches.clear()
        ix.touch_batch(self.mem, self.geo.entries_offset, slots, versions, time.time_ns())

    async def maintain(self, timeout: float) -> None:
        """Flush LRU touches, free expired transfer-only blocks, drain returned slots."""
        self.alloc.drain_returns()
        expired_possible = self.cfg.mode == "transfer"
        if not self._touches and not expired_possible:
            return
        await self._locked(timeout)
        try:
            self._flush_touches_locked()
            if expired_possible:
                now = time.time_ns()
                table = self.index.scan()
                hit = np.flatnonzero((table[:, 0] == ix.READY) & ((table[:, 4] & ix.FLAG_TRANSFER) != 0)
                                     & (table[:, 5] <= now))
                self._evict_many_locked(hit.tolist())
                self.stats.expired += len(hit)
        finally:
            self.lock.release()

    def on_reclaim(self, node_id: int, spans: list[tuple[int, int]]) -> None:
        """Allocator hook (under the lock): a dead node's chunks go away; so do their entries."""
        table = self.index.scan()
        live = (table[:, 0] == ix.READY) | (table[:, 0] == ix.RESERVED)
        inside = np.zeros(len(table), dtype=np.bool_)
        for start, nbytes in spans:
            inside |= live & (table[:, 1] >= start) & (table[:, 1] < start + nbytes)
        slots = np.flatnonzero(inside).astype(np.int64)
        if slots.size:     # payloads are not freed: their chunks go back whole
            ix.evict_batch(self.mem, self.geo.entries_offset, self.index.mask, slots,
                           ix.TOMBSTONE, np.zeros((slots.size, 4), dtype=np.int64))
            self.stats.reclaimed_entries += int(slots.size)

    async def close(self, timeout: float) -> None:
        """Evict unfinished reservations and this node's blocks, return chunks."""
        await self._locked(timeout)
        try:
            self._evict_many_locked([r.slot for r in self._reserved.values()])
            self._reserved.clear()
            table = self.index.scan()
            mine = np.flatnonzero(((table[:, 0] == ix.READY) | (table[:, 0] == ix.RESERVED))
                                  & ((table[:, 6] & 0xFFFF) == self.node_id))
            self._evict_many_locked(mine.tolist())
        finally:
            self.lock.release()
        await self.alloc.close(self.lock, timeout=timeout)
