"""A put's reservation: index entries in this node's lane and payload slots for its new blocks.

Step 1 of a put (``stores/blocks.py`` has the whole protocol): ``Reserver.reserve`` finds the
positions a put writes -- keys this node is already filling plus keys absent from the index --
and reserves the absent ones all or nothing. The steady state takes no lock: slots come from
this node's free lists and its spares, entries go into its own lane (``region/index.py``, "Who
writes what"). The lock is taken when that cannot serve: a chunk to claim, blocks to evict
(this node's LRU first, ``EVICT_AHEAD`` beyond the need), chunks other nodes asked for, a probe
window without a free entry of the lane, or the lane still to be taken over from a previous
incarnation (the first hold). A node with no chunk to make room in asks the owners for chunks
and waits ``CHUNK_WAIT_S`` (``region/alloc.py``, "Starving").

Why a module of its own (issue 37): these were eleven methods of the block lifecycle. The
reserver's ties go one way: it writes reservations into the ``FillBook``, takes slots from the
allocator and spares, evicts through the ``Evictor``, gives chunks through the ``ChunkGiver``,
and reports to the ``PreClaimer``; none of those calls back into it.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from itertools import repeat
from typing import Any

import numpy as np

import tract_kernels as K

from .. import crashpoints as CP
from ..config import EngineConfig
from ..errors import LockTimeout, NodeEvicted, RegionFull, TransferTimeout
from ..keys import KeyBatch
from ..region import Region
from ..region.index import SNAP_COLS, SNAP_SLOT
from ..region import index as ix
from ..region.alloc import (A_CHUNK, A_GEN, A_NBYTES, A_OFFSET, A_OWNER, A_TOKEN, Allocation,
                            Allocator, allocation_rows, allocations_of_rows)
from ..region.chunks import alloc_geometry
from ..sync.lock import GlobalLock
from .chunkgive import ChunkGiver
from .eviction import Evictor
from .fillbook import FillBatch, FillBook, Reservation
from .preclaim import PreClaimer
from .readiness import SMALL_READ
from .spares import Spares, alloc_info
from .stats import StoreStats
from .touches import TouchLog

_NO_LINES = np.empty((0, ix.ENTRY_WORDS), dtype=np.uint64)
"""``reserve_batch_counted``'s ``lines`` for a reservation that makes no batch: nothing recorded."""

EVICT_AHEAD = 64
"""When a locked reservation evicts for space, it evicts up to this many blocks (at least 16,
at most the put's size) beyond its need, so that the puts after it find free slots and reserve
without the lock: in a full prefix cache, one put in ~16-64 takes the lock instead of every one.
The cost is that many blocks' worth of capacity, per node, held free."""

CHUNK_WAIT_S = 2.0
"""How long a put that found no chunk waits for an owner to release one (its ask recorded)."""

OPTIMISTIC_MIN_KEYS = 64
"""A put of at least this many keys may skip its index snapshot (``snapshot_for_put``)."""


class _Starving(RegionFull):
    """No chunk to allocate from; this node's ask for some is recorded (internal: a put
    waits for an owner to release one, then raises RegionFull)."""


async def hold_lock(lock: GlobalLock, stats: StoreStats, timeout: float | None) -> None:
    """Take the global lock, counted in ``stats``; its LockTimeout becomes TransferTimeout."""
    t0 = time.perf_counter()
    try:
        await lock.acquire(timeout=timeout)
    except LockTimeout as e:
        raise TransferTimeout(f"global lock not granted within {timeout} s "
                              f"({lock.statistics()})") from e
    stats.lock_acquisitions += 1
    stats.lock_wait_s += time.perf_counter() - t0


class Reserver:
    """Reserves a put's new blocks for one node over one region (module docstring). Created
    and owned by the ``BlockLifecycle``, which hands it its collaborators."""

    def __init__(self, cfg: EngineConfig, region: Region, lock: GlobalLock, allocator: Allocator,
                 index: ix.PrefixIndex, book: FillBook, stats: StoreStats, evictor: Evictor,
                 giver: ChunkGiver, spares: Spares, preclaimer: PreClaimer, touches: TouchLog,
                 *, lane: int, lockfree: bool, entry_flags: int) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.region = region
        self.lock = lock
        self.alloc = allocator
        self.index = index
        self.geo = index.geo
        self.ageo = alloc_geometry(region)
        self.node_id = cfg.node_id
        self.book = book
        self.stats = stats
        self.evictor = evictor
        self.giver = giver
        self.spares = spares
        self.preclaimer = preclaimer
        self.touches = touches
        self.lockfree = lockfree
        """A lane per node id: this node reserves (and abandons) in its lane without the lock."""
        self.lane = lane
        self.lane_off = index.lane_counters_offset(lane)
        self.entry_flags = entry_flags
        """The ``flags`` word of the entries this node reserves (the lifecycle sets it: its
        mode and namespace tag)."""
        self.lane_taken = not lockfree          # one lane for all: nothing to take over
        self.lane_ready = False
        """Set at this incarnation's first hold of the lock, once it has taken its lane over
        (``clear_lane``); only then does it write the lane without the lock."""
        self.asked = False
        """This node's ask for chunks is recorded (cleared once a locked allocation served)."""
        self.puts_fresh = True
        """The last ``reserve`` found none of its keys present (``snapshot_for_put``)."""
        self.placed = 0
        """Blocks the last successful ``place`` reserved (``reserve``: all placed, no per-key
        look)."""

    @property
    def mem(self) -> K.Mem:
        return self.region.mem

    def snapshot_for_put(self, words: np.ndarray) -> np.ndarray | None:
        """What a put's ``reserve`` starts from: the index rows of ``words``, or -- for a put of
        at least ``OPTIMISTIC_MIN_KEYS`` keys while this node's last put found none of its keys
        present (``puts_fresh``) -- None: every key taken for absent, without reading the
        index (nor building rows that say so: ``reserve`` then reserves every position, ~35-45
        µs less of a whole prompt's path to its first copy on the 2-core VM, in-process A/B,
        ``bench/results/vm-20261208-s55``).

        Why. The snapshot only sorts present keys out before slots are allocated for the rest;
        the reservation kernel probes every key's window anyway and skips a key it finds live
        (``index.reserve_batch``: ``-(2 + slot)``; its slot goes back to the free list). A
        layer-streamed handoff or a prefill's new blocks put fresh keys every time, and a
        cache's caller looks its prefix up before it puts, so the snapshot mostly reads what
        the kernel reads again: 0.2-0.3 µs a key on the 2-core VM, 363-440 µs of a 2048-block
        put's ~1.5 ms reservation. A put that does find present keys costs their slots' take
        and give-back (a few µs), and the next put snapshots again."""
        n = words.shape[0]
        if n >= OPTIMISTIC_MIN_KEYS and self.puts_fresh:
            self.stats.unsnapshotted_puts += 1
            return None
        return self.index.snapshot(words)

    # -- put ----------------------------------------------------------------------------------
    async def reserve(self, kb: KeyBatch, snap: np.ndarray | None,
                      timeout: float | None) -> list[int]:
        """Step 1 of a put: the positions of ``kb.keys`` it writes, ascending -- blocks this node
        is already filling (an earlier layer's put), plus those absent from the index (``snap``
        from ``snapshot_for_put``; None: every key taken for absent), reserved now under one
        hold of the global lock. Present blocks (anyone's) are skipped and counted. Raises
        RegionFull (nothing reserved: all or nothing), TransferTimeout (lock), NodeEvicted."""
        keys = kb.keys
        todo: list[int] = []          # positions in keys this call writes
        new: list[int] = []           # positions that need a reservation
        reserved = self.book.reserved
        skipped = self.stats.blocks_skipped
        if snap is None and not reserved:       # a fresh put, none of ours in flight
            new = list(range(len(keys)))
        else:
            if snap is None:
                snap = np.full((len(keys), SNAP_COLS), -1, dtype=np.int64)
            if not reserved and len(keys) > SMALL_READ:   # none of ours in flight: numpy
                present = snap[:, SNAP_SLOT] >= 0
                self.stats.blocks_skipped += int(present.sum())
                new = np.flatnonzero(~present).tolist()
            else:
                for i, k in enumerate(keys):
                    if k in reserved:
                        todo.append(i)
                    elif snap[i, SNAP_SLOT] >= 0:
                        self.stats.blocks_skipped += 1   # present, or produced by another node
                    else:
                        new.append(i)
        if new:
            await self._reserve_or_wait(kb, new, timeout)
            got = (new if self.placed == len(new) else      # all placed: no per-key look
                   [i for i in new if keys[i] in reserved])
            todo = sorted(set(todo).union(got)) if todo else got
        self.puts_fresh = self.stats.blocks_skipped == skipped   # ``snapshot_for_put``
        return todo

    async def _reserve_or_wait(self, kb: KeyBatch, positions: list[int],
                               timeout: float | None) -> None:
        """``_reserve``; when it starves for chunks (its ask recorded), wait -- up to
        ``CHUNK_WAIT_S`` or the put's timeout -- for an owner to release one, then retry."""
        wait_s = CHUNK_WAIT_S if timeout is None else min(CHUNK_WAIT_S, timeout)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await self._reserve(kb, positions, timeout)
                return
            except _Starving as e:
                self.asked = True
                if time.monotonic() >= deadline:
                    raise RegionFull(f"{e}; none came free within {wait_s:.1f} s (owners "
                                     f"release chunks beyond their fair share when they next "
                                     f"hold the lock)") from None
            table = self.alloc.table
            while time.monotonic() < deadline and table.find_free() is None:
                await asyncio.sleep(0.005)

    async def _reserve(self, kb: KeyBatch, positions: list[int], timeout: float | None) -> None:
        """Reserve entries and payload for ``positions``: without the global lock when this node
        has a lane of its own and its free slots suffice (``_reserve_lockfree``), else under one
        hold of the lock (``_reserve_locked``)."""
        pc = self.preclaimer
        pc.put_started()
        have = self.spares.take(len(positions))
        if self.lane_ready:
            done, have = self._reserve_lockfree(kb, positions, have)
            if done:
                pc.note_put(len(positions))
                return
        with pc.reserving():            # waiting for the lock is not idle
            await self._reserve_locked(kb, positions, timeout, have)
        pc.note_put(len(positions))

    def _reserve_lockfree(self, kb: KeyBatch, positions: list[int],
                          have: list[Allocation]) -> tuple[bool, list[Allocation]]:
        """The steady-state reservation (index.py, "Who writes what"): slots from this node's
        free lists (``alloc_many_nowait``, which first checks that this node was not judged
        dead), entries in this node's lane. False when the lock is needed instead -- a chunk to
        claim, blocks to evict, another node asking for chunks, a probe window without a free
        entry of this lane -- with nothing left changed but the slots already taken from the
        free lists, which are returned for the locked path to use (a large put that needs new
        chunks would otherwise allocate its first slots twice). ``have``: slots already taken
        for this batch (spares)."""
        if not self.giver.check_passes():
            return False, have
        count = len(positions)
        allocs: list[Allocation] | np.ndarray = have
        if len(have) < count:
            want = count - len(have)
            if want > SMALL_READ:        # many: numpy rows, no Allocation objects
                got = self.alloc.alloc_many_nowait(self.layout.block_bytes, want, rows=True)
                allocs = np.concatenate([allocation_rows(have), got]) if have else got
            else:
                allocs = have + self.alloc.alloc_many_nowait(self.layout.block_bytes, want)
        if len(allocs) < count:
            # the locked path takes what was taken (and frees it on failure) as Allocations
            return False, (allocations_of_rows(allocs) if isinstance(allocs, np.ndarray)
                           else allocs)
        if CP.ARMED:
            CP.hit("reserve.lockfree")
        # the entries and slot tags ``_place`` writes are stores into this node's chunks: a node
        # paused since its slots were taken may have been reclaimed meanwhile (issue 36, A1);
        # its slots are then another node's to carve, and nothing is left to free
        self.alloc.check_not_fenced()
        self.stats.lockfree_reservations += 1
        early = getattr(kb, "early", None)
        if early is None or not isinstance(allocs, np.ndarray) or count != len(kb.keys):
            return self.place(kb, positions, allocs) is None, []
        return self._place_after_early(kb, positions, allocs, early), []

    def _place_after_early(self, kb: KeyBatch, positions: list[int], allocs: np.ndarray,
                           early: Any) -> bool:
        """``place`` with the put's copies started first (``stores/txn.py``, ``EarlyCopies``;
        docs/design.md, "Copies before the entries"): every key is new and every slot is in
        hand, so the offsets each key gets if the placement succeeds whole are known now -- the
        slots in ascending order, as ``place`` pairs them -- and the copies can run while the
        entries are written (a whole prompt's placement, 65-95 µs on the 2-core VM, off the path
        to its first DMA). Any other outcome voids them before this returns: ``place`` gave slots
        back, and none may be taken again while a copy into it can still land; nothing can take
        one before this returns to the event loop (the slots are in this node's chunks, which
        only this loop hands out or gives away). Returns what ``place`` is None."""
        allocs = allocs[np.argsort(allocs[:, A_OFFSET], kind="stable")]
        try:
            early.start(np.ascontiguousarray(allocs[:, A_OFFSET]))
        except BaseException:       # (the back-end's own errors it keeps: an interrupt)
            early.void()
            self._free_allocs(allocs)
            raise
        if not early.started:
            return self.place(kb, positions, allocs, ordered=True) is None
        try:
            full = self.place(kb, positions, allocs, ordered=True)
        except BaseException:
            early.void()
            raise
        if full is not None or self.placed != len(positions):
            self.stats.early_copies_voided += 1
            early.void()
        else:
            self.stats.early_copies += 1
        return full is None

    async def _reserve_locked(self, kb: KeyBatch, positions: list[int], timeout: float | None,
                              have: list[Allocation] | None = None) -> None:
        """Reserve under one hold of the global lock: allocation with chunk claims and LRU
        eviction (``_alloc_many_locked``), and, where a key's probe window holds no free entry
        of this node's lane, the eviction of this lane's oldest entry there. ``have``: slots
        already allocated for this batch (freed here on any failure)."""
        try:
            await hold_lock(self.lock, self.stats, timeout)
        except BaseException:
            if have:
                self.alloc.free_many(have)
            raise
        try:
            if CP.ARMED:
                CP.hit("reserve.locked")
            self.lock.check_token()
            if not self.lane_taken:
                # this incarnation's first hold: take the lane over from any predecessor
                self.stats.reclaimed_entries += self.index.clear_lane_locked(self.lane)
                self.lane_taken = True
                self.lane_ready = self.lockfree
            self.touches.flush()
            if self.giver.due():
                self.give_chunks_locked()
            for attempt in range(2):
                got = have or []
                try:
                    rows = self._alloc_many_locked(len(positions) - len(got))
                    allocs = np.concatenate([allocation_rows(got), rows]) if got else rows
                except BaseException:
                    if have:
                        self.alloc.free_many(have)
                    raise
                have = None
                if CP.ARMED:
                    CP.hit("reserve.allocated")
                try:
                    # ``_place`` stores entries and slot tags under this hold: a holder paused
                    # since its check may be revoked and reclaimed by now, its slots carved
                    # into another node's blocks (issue 36, A1: the paused-fencing test saw a
                    # resumed holder's tags turn another node's reads into misses)
                    self.lock.check_token()
                except BaseException:
                    with contextlib.suppress(NodeEvicted):     # reclaimed: nothing to free
                        self._free_allocs(allocs)
                    raise
                full = self.place(kb, positions, allocs)
                if full is None:
                    return
                if attempt or not self.evictor.windows(kb.words[np.asarray(full)]):
                    raise RegionFull(
                        f"index probe window of {self.geo.max_probe} groups holds no free "
                        f"entry of node {self.node_id}'s lane, and none of its blocks there can "
                        f"be evicted (capacity {self.geo.capacity}, {self.geo.lanes} lanes); "
                        f"create the region with a larger index (EngineConfig.index_capacity)")
        finally:
            self.lock.release()

    def place(self, kb: KeyBatch, positions: list[int],
              allocs: list[Allocation] | np.ndarray, *, ordered: bool = False
              ) -> list[int] | None:
        """Index entries in this node's lane for ``positions``, with payloads ``allocs`` (a
        list, or ``allocation_rows``; freed here when not used): None when placed (keys found
        live meanwhile are skipped), else the positions whose probe window had no free entry --
        and then nothing is reserved (all or nothing: the region is as it was). Lock-free with
        a lane per node; else the caller holds the lock. ``ordered``: ``allocs`` (rows) are in
        ascending payload order already."""
        keys, words = kb.keys, kb.words
        mine: list[tuple[bytes, int]] = []
        fast: tuple[list[bytes], np.ndarray] | None = None   # all reserved: (keys, previous)
        self.placed = 0
        if not ordered and isinstance(allocs, np.ndarray) and len(allocs) > 1:
            # the request's blocks in ascending payload order: free lists hand slots back in
            # whatever order they were freed (reversed runs after a consumer freed a request),
            # and a GPU transfer moves each run of evenly spaced offsets in one 2-D copy
            # (cuda/direct.py): in key order, the run covers what the free slots allow. Nothing
            # depends on the pairing order (each key's slot travels with its reservation): it
            # decides only which physical slots later puts take. (The disagreement stress of
            # tests/region/test_index_vs_alloc.py once double-freed a slot under this order and
            # not under another: its helper freed stale entries' slots again, a test bug.)
            allocs = allocs[np.argsort(allocs[:, A_OFFSET], kind="stable")]
        try:
            now = time.time_ns()
            transfer = self.cfg.mode == "transfer"
            flags = self.entry_flags
            deadline = now + int(self.cfg.transfer_deadline_s * 1e9) if transfer else 0
            producer = self.node_id  # the epoch lives in the node table; the id suffices here
            res = np.zeros((len(positions), 3), dtype=np.int64)
            if not isinstance(allocs, np.ndarray) and len(allocs) <= SMALL_READ:
                # a few: tuples beat five numpy operations
                ainfo = np.array([alloc_info(a) for a in allocs],
                                 dtype=np.uint64).reshape(-1, 4)
                offs: list[int] | None = [a.offset_bytes for a in allocs]
                chunks: list[int] | None = [a.chunk_index for a in allocs]
                offs_np = chunks_np = None
            else:
                a = allocs if isinstance(allocs, np.ndarray) else allocation_rows(allocs)
                ainfo = np.empty((len(allocs), 4), dtype=np.uint64)
                ainfo[:, 0] = a[:, A_OFFSET]
                ainfo[:, 1] = a[:, A_NBYTES]
                ainfo[:, 2] = a[:, A_OWNER] | (a[:, A_GEN] << 16)
                ainfo[:, 3] = a[:, A_TOKEN]
                offs_np = a[:, A_OFFSET].copy()
                chunks_np = a[:, A_CHUNK].copy()
                offs = chunks = None                  # lists only for per-key reservations
            g = self.geo
            # all reserved: a batch -- of any size for a layer-streamed put (its later layers
            # then find the batch by one list comparison, reuse its offsets array and publish
            # without a per-key loop, also early from the CUDA poller's thread), of more than a
            # few blocks for a whole-block put (numpy's ~1 µs per step made a 1-block put
            # slower, 2ba0a72); a batch records its entries' words (``lines``) in the same call
            batch_min = 1 if getattr(kb, "layer", None) is not None else SMALL_READ + 1
            lines = (np.empty((len(positions), ix.ENTRY_WORDS), dtype=np.uint64)
                     if len(positions) >= batch_min else _NO_LINES)
            try:
                # one kernel call: the reservation, then (all reserved) the publishes counter
                counted = ix.reserve_batch_counted(
                    self.mem, self.lane_off, g.entries_offset, self.index.tgeo,
                    self.index.mask, g.max_probe, g.lanes, self.lane,
                    words if len(positions) == len(keys) else
                    words[np.asarray(positions, dtype=np.int64)], ainfo, now, producer, flags,
                    deadline, res, lines)
            except BaseException:
                self._free_allocs(allocs)
                raise
            full: list[int] = []
            unused: list[int] = []
            reserved = self.book.reserved
            if len(positions) >= batch_min and (res[:, 0] >= 0).all():
                ks = keys if len(positions) == len(keys) else [keys[i] for i in positions]
                batch = FillBatch(ks, res[:, 0].copy(), res[:, 2].copy(),
                                  offs_np if offs_np is not None else
                                  np.asarray(offs, dtype=np.int64),
                                  chunks_np if chunks_np is not None else
                                  np.asarray(chunks, dtype=np.int64), lines)
                reserved.update(zip(ks, repeat(batch)))
                fast = (ks, res[:, 1])     # ``mine`` is built only if they must be undone
            elif offs is None:
                offs, chunks = offs_np.tolist(), chunks_np.tolist()
            for j, (slot, prev, version) in enumerate(res.tolist() if fast is None else ()):
                i = positions[j]
                if slot >= 0:
                    reserved[keys[i]] = Reservation(slot, version, offs[j], chunks[j])
                    mine.append((keys[i], prev))
                    continue
                unused.append(j)
                if slot == -1:
                    full.append(i)
                else:                               # another node reserved it since our snapshot
                    self.stats.blocks_skipped += 1
            if unused:
                self._free_allocs(allocs[np.asarray(unused)] if isinstance(allocs, np.ndarray)
                                  else [allocs[j] for j in unused])
            if full:
                self._undo(mine)
                return full
            placed = len(mine) if fast is None else len(fast[0])
            if not counted:
                self.index.bump_counter(self.lane, ix.LN_PUBLISHES, placed)
            if CP.ARMED:
                CP.hit("reserve.indexed")
            self.placed = placed
            return None
        except BaseException:
            if fast is not None:
                mine = list(zip(fast[0], fast[1].tolist()))
            self._undo(mine)
            raise

    def _free_allocs(self, allocs: list[Allocation] | np.ndarray) -> None:
        """Give slots back, as a list or as ``allocation_rows``."""
        if isinstance(allocs, np.ndarray):
            allocs = allocations_of_rows(allocs)
        if allocs:
            self.alloc.free_many(allocs)

    def _undo(self, mine: list[tuple[bytes, int]]) -> None:
        """Take back this call's reservations ``mine`` (key, previous state), newest first: an
        entry that was EMPTY goes back to EMPTY (no probe chain can run through it yet)."""
        self.book.split_keys([k for k, _ in mine])
        for state in (ix.EMPTY, ix.TOMBSTONE):
            back = [self.book.reserved.pop(k).slot for k, prev in reversed(mine) if prev == state]
            self.evictor.slots(back, count=False, new_state=state)
        mine.clear()

    def _alloc_many_locked(self, count: int) -> np.ndarray:
        """``count`` block slots (``allocation_rows``), evicting this node's LRU blocks while
        the region is full. Raises _Starving (RegionFull: no chunk to make room in, and the ask
        for one recorded), RegionFull."""
        nbytes = self.layout.block_bytes
        parts: list[np.ndarray] = []
        have = 0
        evicted = 0
        table = self.alloc.table
        try:
            while have < count:
                parts.append(self.alloc.alloc_many_locked(nbytes, count - have, self.lock,
                                                          partial=True, rows=True))
                have += len(parts[-1])
                if have >= count:
                    break
                need = count - have
                g = self.ageo
                per_chunk = max(1, g.chunk_bytes // self.alloc.class_for(nbytes))
                most = g.nchunks * per_chunk
                if count > most:   # no eviction could ever make room: say the real limit
                    raise RegionFull(
                        f"a put of {count} new {nbytes}-byte blocks is larger than the whole "
                        f"region: {self.region.path} ({self.region.size_bytes} bytes) holds "
                        f"at most {most} of them ({g.nchunks} chunks of "
                        f"{g.chunk_bytes} bytes); put at most {most} blocks at a "
                        f"time, or create a larger region (EngineConfig.region_bytes)")
                if not self.alloc.holds_class(nbytes):
                    # No chunk of ours to make room in, and none free: evicting others' blocks
                    # would only return their slots to them (a node that joined a full region
                    # once evicted ~20 000 blocks in a 30 s stress and starved everyone's
                    # reads). Ask the owners for chunks instead (alloc.py, "Starving").
                    self.stats.full_without_chunk += 1
                    table.set_wanted(self.node_id, -(-need // per_chunk))
                    raise _Starving(f"node {self.node_id} holds no chunk of "
                                    f"{self.alloc.class_for(nbytes)}-byte slots and the region "
                                    f"has none free; it asked the owners for "
                                    f"{-(-need // per_chunk)}")
                budget = 64 + 2 * count - evicted
                # evict a little ahead of need: the slots left over serve the next puts
                # without the lock (EVICT_AHEAD)
                ahead = min(EVICT_AHEAD, max(count, 16)) if self.lockfree else 0
                got = self.evictor.lru(min(need + ahead, budget)) if budget > 0 else 0
                if got == 0:
                    live = self.region.nodes.live_ids(timeout_s=self.cfg.liveness_timeout_s)
                    others = [i for i in live if i != self.node_id]
                    why = (f"no space for {need} more {nbytes}-byte blocks after {evicted} "
                           f"evictions of this node's blocks, and none left to evict (blocks "
                           f"still being written, and transfer-only blocks not yet consumed, are "
                           f"not evictable)")
                    if not others:
                        raise RegionFull(why)
                    table.set_wanted(self.node_id, -(-need // per_chunk))
                    raise _Starving(f"{why}; it asked nodes {others} for "
                                    f"{-(-need // per_chunk)} chunks")
                evicted += got
                self.alloc.drain_returns()
        except BaseException:
            if parts:
                self._free_allocs(np.concatenate(parts))
            raise
        if self.asked:
            table.set_wanted(self.node_id, 0)
            self.asked = False
        if not parts:
            return allocation_rows([])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def give_chunks_locked(self) -> int:
        """Release chunks to nodes that asked for some, none with a put of ours in flight
        (``stores/chunkgive.py``); how many. Caller holds the lock."""
        return self.giver.give_locked(self.book.busy_chunks)
