"""The one owner of a block's lifecycle in the region: reserve, fill, publish, read, touch, abandon.

Every KV byte that enters or leaves the region goes through this module's steps; the copy
back-ends (the CPU copy of ``stores/region.py``, the CUDA DMA of ``cuda/store.py``) only move
bytes between the addresses it hands out and the caller's tensors. The byte-level protocol is
the essay of ``region/index.py``; this is its asyncio face, deciding *when* to take the global
lock (once per reservation batch, and for maintenance) and keeping this node's bookkeeping.

A put::

    kb = KeyBatch(keys); snap = blocks.snapshot_for_put(kb.words)   # keys and their words
    todo = await blocks.reserve(kb, snap, timeout)               # positions this put writes
    res = blocks.reservations(keys, todo)                        # their payload offsets
    ... copy layer(s) into [r.offset, +block_bytes) ...
    blocks.publish(keys, todo, res, layer)                       # layer bits, READY when whole
    # on any failure or cancellation, once no copy can still land: await blocks.abandon(keys)

A get::

    words, snap = await blocks.prepare_read(keys, layer, timeout)   # waits, checks bounds
    kb = KeyBatch(keys, words)
    ... copy from snap[:, SNAP_POFF] (payload offsets) ...
    blocks.validate_read(kb, snap, nbytes)   # after the copy (or its DMA): else a miss
    await blocks.consume(kb, snap, layer)     # transfer-only mode

(``stores/txn.py``'s transactions run these steps; each is its operation's ``KeyBatch``.)

A put or get of a few whole blocks from the CPU (``fused.FUSED_MAX_BLOCKS``) takes one kernel
call for all of these steps instead (``put_fused``, ``get_fused``; ``stores/fused.py`` says
why): the same stores, flushes and fences in the same order, without the Python between them.
Its payload slots come from this node's *spares*: slots taken from its free lists ahead of
need, ``SPARE_SLOTS`` at a time (one allocator call for many puts). Spares are this node's
used slots that no entry names yet; the step-by-step path takes them first, and they go back
to the free lists before chunks are given away and at close.

Pre-claimed chunks and evicting ahead: in this node's idle moments a background task claims
chunks (or, in a full region, evicts this node's LRU blocks) so that the next put of the size
seen reserves without the lock (``stores/preclaim.py``). This class reports its puts and reads
to it (``preclaimer``) and gives away the pre-claimed chunks first when another node starves
(``stores/chunkgive.py``).

Block lifetime. A block lives in a slot of its producer's heap. It is READY until evicted (LRU
under memory pressure), consumed (transfer-only mode), expired (transfer-only deadline), or
reclaimed with its owner's chunks when the owner node dies or leaves. A put that fails or is
cancelled after reserving evicts its own entries (after its copies have finished: no write ever
lands in a slot that was handed out again, docs/design.md invariant 7).

Its parts. The lifecycle keeps the protocol's order and the steps that touch both sides
(publication, the fused paths, abandon, maintenance, close); each concern of its own lives in
a collaborator it builds and owns, tied one way (none calls back into the lifecycle):
``FillBook`` (``stores/fillbook.py``: the blocks in flight), ``Reserver``
(``stores/reservation.py``: entries and slots for a put, the lock when needed, eviction for
space), ``ReadSide`` (``stores/reading.py``: a read's snapshot, checks and revalidation),
``Consumer`` (``stores/consume.py``: transfer mode's frees), ``Evictor``, ``ChunkGiver``,
``Spares``, ``TouchLog``, ``ReadyWaits`` and ``PreClaimer``. The methods above that name a
collaborator's step (``reserve``, ``prepare_read``, ...) hand it on, so that the copy
back-ends and their tests see one object.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from operator import attrgetter
from typing import Any, Callable

import numpy as np

import tract_kernels as K

from .. import crashpoints as CP
from ..config import EngineConfig
from ..errors import NodeEvicted
from ..keys import KeyBatch, keys_to_words
from ..region import Region
from ..region import cpumarks
from ..region.index import SNAP_COLS, SNAP_POFF, SNAP_SLOT, SNAP_STATE, SNAP_VERSION
from ..region import index as ix
from ..region.namespaces import ns_flags
from ..region.alloc import Allocation, Allocator, allocations_of_rows
from ..region.chunks import alloc_geometry
from ..sync.lock import GlobalLock
from . import doorbell as db
from .chunkgive import ChunkGiver
from .consume import Consumer
from .eviction import Evictor
from .fillbook import FillBatch, FillBook, Reservation, Reserved
from .spares import SPARE_SLOTS, Spares
from .touches import TouchLog
from . import fused
from . import plan as kvplan
from . import waits
from .layouts import LayoutGuard
from .preclaim import PreClaimer
from .readiness import ReadyWaits
from .reading import ReadSide
from .reservation import Reserver, hold_lock
from .stats import StoreStats

_SLOT_OF = attrgetter("slot")

RETURN_WAIT_S = 2.0
"""How long a closing node retries returns that did not fit their owners' rings
(``_deliver_returns``)."""
RETURN_RETRY_S = 0.01

class BlockLifecycle:
    """Reserve -> fill layers -> publish -> validate a read -> touch -> abandon, for one node
    over one region (module docstring). Created and owned by the RegionStore."""

    def __init__(self, cfg: EngineConfig, region: Region, lock: GlobalLock, allocator: Allocator,
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
        self.spin_ns = 1000 * (waits.auto_wait_spin_us() if cfg.wait_spin_us is None
                               else cfg.wait_spin_us)
        """How long a same-host wait spins before it sleeps (``readiness.ReadyWaits``)."""
        index.meta_threads = ix.auto_meta_threads(waits.usable_cpus(),
                                                  region.mem[K.MEM_BACKEND] == K.BACKEND_HW)
        self.stats = StoreStats()
        self.book = FillBook()
        """This node's blocks in flight (``stores/fillbook.py``)."""
        self.touches = TouchLog(region, self.geo.entries_offset)
        """Reads recorded for the approximate LRU (``stores/touches.py``)."""
        lockfree = index.lockfree_for(region.max_nodes)
        self.lane = self.node_id if lockfree else 0
        """This node's lane of the index: its own with a lane per node id (then it reserves
        and abandons there without the lock), else the one shared lane 0."""
        self.evictor = Evictor(region, index, allocator, self.layout, self.stats,
                               lane=self.lane, node_id=self.node_id)
        """Tombstones entries and frees their payloads (``stores/eviction.py``)."""
        self.pause_after_snapshot: Any = None
        """Test seam: an awaitable factory a copy back-end runs between a read's snapshot and
        its copy, so a test can evict and rewrite the block exactly there (deterministic
        torn-read control)."""
        lo, hi = kvplan.layer_mask(self.layout, None)
        self._all_lo, self._all_hi = lo, hi
        self.doorbell = db.Doorbell(region, self.node_id, allocator.epoch)
        """Same-host wake-ups of waits on this region (``stores/doorbell.py``)."""
        self._db_off, self._db_nodes = self.doorbell.offset, self.doorbell.max_nodes
        self.waits = ReadyWaits(self)
        """A read's waits for its blocks (``stores/readiness.py``)."""
        self.spares = Spares(allocator, self.layout.block_bytes,
                             SPARE_SLOTS + fused.FUSED_MAX_BLOCKS)
        """Slots taken from the free lists ahead of need (``stores/spares.py``)."""
        self.giver = ChunkGiver(region, allocator, index, lock, self.evictor, self.spares,
                                self.stats, node_id=self.node_id,
                                liveness_timeout_s=cfg.liveness_timeout_s)
        """Answers other nodes' asks for chunks (``stores/chunkgive.py``)."""
        pb = cfg.preclaim_bytes
        self.preclaimer = PreClaimer(self, (1 << 62) if pb is None else pb // self.layout.block_bytes)
        """The pre-claim task's state (``stores/preclaim.py``): puts and reads report to it."""
        self.reserver = Reserver(cfg, region, lock, allocator, index, self.book, self.stats,
                                 self.evictor, self.giver, self.spares, self.preclaimer,
                                 self.touches, lane=self.lane, lockfree=lockfree,
                                 entry_flags=ix.FLAG_TRANSFER if cfg.mode == "transfer" else 0)
        """Step 1 of a put: index entries and slots for its new blocks
        (``stores/reservation.py``)."""
        self.reader = ReadSide(cfg, region, index, self.waits, self.stats, self.preclaimer,
                               self.touches)
        """A read's checks before and after its copy (``stores/reading.py``)."""
        self.consumer = Consumer(cfg, lock, index, self.evictor, self.stats)
        """Transfer mode's frees of consumed blocks (``stores/consume.py``)."""
        self.closing = False
        """Set by ``close``: the pre-claim task claims nothing after it."""
        self._next_expiry = 0.0         # monotonic time of the next expiry pass (maintain)
        self.reclaims_dead: Callable[[], bool] = lambda: True
        """Whether this node's maintenance reclaims dead nodes' chunks (``maintain``): the
        Engine makes it the node that hosts the lock manager, one janitor per rack instead of
        every node taking the lock for the same reclaim."""
        self.ns_tag = 0
        """This node's namespace tag (``stores/layouts.py``), carried in the ``flags`` of the
        entries it reserves; 0 until the Engine records its namespace (``use_layouts``)."""
        self._fp = self._fused_params()
        self._fres = np.zeros((fused.FUSED_MAX_BLOCKS, 3), dtype=np.int64)
        self._fsnap = np.zeros((fused.FUSED_MAX_BLOCKS, SNAP_COLS), dtype=np.int64)
        self._fok = np.zeros(fused.FUSED_MAX_BLOCKS, dtype=np.bool_)

    def use_layouts(self, guard: LayoutGuard) -> None:
        """From now on reserve entries under ``guard``'s namespace tag and check the namespace
        of every block a read finds (``stores/layouts.py``). Before the first put."""
        self.reader.layouts = guard
        self.ns_tag = guard.tag
        r = self.reserver
        r.entry_flags = (r.entry_flags & ix.FLAG_TRANSFER) | ns_flags(guard.tag)
        self._fp[fused.P_FLAGS] = r.entry_flags
        self._fp[fused.P_NS_TAG] = guard.tag

    def _fused_params(self) -> np.ndarray:
        """The constant arguments of the fused kernels (``fused.P_*``) for this node."""
        g, ag = self.geo, self.ageo
        p = np.zeros(fused.P_FIELDS, dtype=np.int64)
        p[fused.P_LOFF] = self.reserver.lane_off
        p[fused.P_EOFF] = g.entries_offset
        p[fused.P_MASK] = self.index.mask
        p[fused.P_MAX_PROBE] = g.max_probe
        p[fused.P_LANES] = g.lanes
        p[fused.P_LANE] = self.lane
        p[fused.P_PRODUCER] = self.node_id
        p[fused.P_FLAGS] = self.reserver.entry_flags
        p[fused.P_NS_TAG] = self.ns_tag
        p[fused.P_ALL_LO] = np.uint64(self._all_lo).astype(np.int64)
        p[fused.P_ALL_HI] = np.uint64(self._all_hi).astype(np.int64)
        p[fused.P_DBOFF] = self._db_off
        p[fused.P_DBNODES] = self._db_nodes
        p[fused.P_FENCE_OFF] = self.alloc.geo.count_off(self.node_id) + 8
        p[fused.P_EPOCH] = self.alloc.epoch
        p[fused.P_POS_STEP] = kvplan.block_step(self.layout)
        p[fused.P_CHUNKS_LO] = ag.chunks_offset
        p[fused.P_CHUNKS_END] = ag.chunks_offset + ag.nchunks * ag.chunk_bytes
        p[fused.P_BLOCK_BYTES] = self.layout.block_bytes
        return p

    # -- helpers ------------------------------------------------------------------------------
    @property
    def mem(self) -> K.Mem:
        return self.region.mem

    @property
    def in_flight(self) -> int:
        """Blocks this node has reserved and not yet published whole."""
        return len(self.book)

    def allocation_of(self, poff: int, pnb: int, owner_word: int, token: int) -> Allocation:
        """The allocator's record of an index entry's payload (offset, nbytes, owner word, token
        as the entry holds them): what a free of that payload takes. Raises ValueError for a
        payload that is not a block slot of this region."""
        rows = self.evictor.payload_rows(np.array([[poff, pnb, owner_word, token, 1]], dtype=np.int64))
        if not len(rows):
            raise ValueError(f"payload ({poff}, {pnb}) is not a block slot of this region")
        return allocations_of_rows(rows)[0]

    async def hold_lock(self, timeout: float | None) -> None:
        """Take the global lock; its LockTimeout becomes the store's TransferTimeout."""
        await hold_lock(self.lock, self.stats, timeout)

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """Leading keys resident and complete (lock-free)."""
        if not keys:
            return 0
        return self.index.lookup(keys_to_words(keys))


    def snapshot(self, words: np.ndarray) -> np.ndarray:
        """The index rows of ``words`` (``PrefixIndex.snapshot``), lock-free."""
        return self.index.snapshot(words)

    # -- the collaborators' steps, as the copy back-ends call them ----------------------------
    def snapshot_for_put(self, words: np.ndarray) -> np.ndarray | None:
        """``Reserver.snapshot_for_put``."""
        return self.reserver.snapshot_for_put(words)

    async def reserve(self, kb: KeyBatch, snap: np.ndarray | None,
                      timeout: float | None) -> list[int]:
        """Step 1 of a put (``Reserver.reserve``): the positions of ``kb.keys`` it writes."""
        return await self.reserver.reserve(kb, snap, timeout)

    def filling(self, keys: list[bytes]) -> Reserved | None:
        """``FillBook.filling``: a later layer's reservations, without the index."""
        return self.book.filling(keys)

    def reservations(self, keys: list[bytes], positions: list[int]) -> Reserved:
        """``FillBook.reservations``."""
        return self.book.reservations(keys, positions)

    payload_offsets = staticmethod(FillBook.payload_offsets)

    def read_words(self, keys: list[bytes]) -> np.ndarray:
        """``ReadSide.read_words``."""
        return self.reader.read_words(keys)

    async def prepare_read(self, keys: list[bytes], layer: int | None,
                           timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-2 of a read (``ReadSide.prepare_read``): the key words and the snapshot."""
        return await self.reader.prepare_read(keys, layer, timeout)

    def prepare_known(self, rows: np.ndarray, layer: int) -> np.ndarray | None:
        """Steps 1-2 of a later layer's read by a kept snapshot (``ReadSide.prepare_known``)."""
        return self.reader.prepare_known(rows, layer)

    def read_seen(self) -> None:
        """Steps 1-2 of a layer read that needs no look (``ReadSide.read_seen``)."""
        self.reader.read_seen()

    def validate_read(self, kb: KeyBatch, snap: np.ndarray, nbytes: int, *,
                      cpu: bool = True, layer: int | None = None) -> None:
        """Step 4 of a read (``ReadSide.validate_read``), after its copy."""
        self.reader.validate_read(kb, snap, nbytes, cpu=cpu, layer=layer)

    def count_read(self, keys: list[bytes], ok: np.ndarray, bad: int, nbytes: int,
                   slots: np.ndarray, versions: np.ndarray,
                   cpu_poffs: np.ndarray | None = None, layer: int | None = None) -> None:
        """``ReadSide.count_read``."""
        self.reader.count_read(keys, ok, bad, nbytes, slots, versions, cpu_poffs, layer)

    @property
    def cpu_marks(self) -> cpumarks.CpuMarks:
        """This host's record of the payload its CPUs may cache (``ReadSide.cpu_marks``)."""
        return self.reader.cpu_marks

    @property
    def layouts(self) -> LayoutGuard | None:
        """The read-side check of the blocks' namespaces (``use_layouts``); None: none."""
        return self.reader.layouts

    @layouts.setter
    def layouts(self, guard: LayoutGuard | None) -> None:
        self.reader.layouts = guard

    @property
    def validate_reads(self) -> bool:
        """``ReadSide.validate_reads`` (the torn-read test's negative control turns it off)."""
        return self.reader.validate_reads

    @validate_reads.setter
    def validate_reads(self, on: bool) -> None:
        self.reader.validate_reads = on

    def touch(self, slots: np.ndarray, versions: np.ndarray) -> None:
        """Record reads for the approximate LRU (``stores/touches.py``)."""
        self.touches.record(slots, versions)

    async def consume(self, kb: KeyBatch, snap: np.ndarray, layer: int | None) -> None:
        """Transfer mode's last step of a read (``Consumer.consume``), with the keys' words
        (a parallel read's transaction may not have computed them)."""
        if kb.words is None:
            kb.words = self.reader.read_words(kb.keys)
        await self.consumer.consume(kb, snap, layer)

    async def drain_consumed(self) -> None:
        """Wait until the deferred frees queued so far are done (``Consumer.drain``)."""
        await self.consumer.drain()


    def drop_spares(self) -> None:
        """Give every spare slot back to the free lists (before chunks are released)."""
        self.spares.drop()

    def put_fused(self, kb: KeyBatch, src: int, tmpl: np.ndarray) -> int | None:
        """A whole put of a few whole blocks (``fused.put_blocks``: reservation in this node's
        lane, copy from private memory at ``src`` by the plan template ``tmpl``, publish, in one
        kernel call); returns the blocks stored, or None when this put needs the step-by-step
        path (nothing then changed): the lane not yet taken over, a crash test armed, a key of
        this node in flight, too few free slots without the lock, a probe window without a
        free entry of the lane, or a look at other nodes' asks due. Raises NodeEvicted."""
        keys, words = kb.keys, kb.words
        n = len(keys)
        if (not self.reserver.lane_ready or CP.ARMED or self.book.any_of(keys)
                or not self.giver.check_passes()):
            return None
        sp = self.spares
        if len(sp.allocs) < n and not sp.refill(n):
            return None
        c = len(sp.allocs)
        res = self._fres[:n]
        now = time.time_ns()
        deadline = (now + int(self.cfg.transfer_deadline_s * 1e9)
                    if self.cfg.mode == "transfer" else 0)
        st = int(fused.put_blocks(self.mem, self._fp, self.index.tgeo, words,
                                  sp.info[c - n:c], tmpl, np.uint64(src), now,
                                  deadline, res))
        if st == fused.FENCED:
            raise NodeEvicted(f"node {self.node_id} (epoch {self.alloc.epoch}) was judged dead "
                              f"and its chunks were reclaimed: rejoin before allocating again")
        rows = res.tolist()
        used = [j for j in range(n) if rows[j][0] >= 0]
        if len(used) == n:
            del sp.allocs[c - n:]
        else:                      # keys skipped (or not reached): their slots stay spares
            sp.settle_top(n, [j for j in range(n) if rows[j][0] < 0])
        self.stats.lockfree_reservations += 1
        if st == fused.WINDOW_FULL:
            # take back what it reserved, newest first (as ``Reserver._undo``: an entry that was EMPTY
            # goes back to EMPTY); the locked path evicts in the full window
            for state in (ix.EMPTY, ix.TOMBSTONE):
                self.evictor.slots([rows[j][0] for j in reversed(used)
                                         if rows[j][1] == state], count=False, new_state=state)
            return None
        k = len(used)
        self.stats.blocks_skipped += n - k
        self.stats.blocks_stored += k
        self.stats.bytes_put += k * self.layout.block_bytes
        self.stats.puts += 1
        self.stats.fused_puts += 1
        if st:
            self.doorbell.ring(st)
        return k

    def publish_early(self, res: Reserved, layer: int | None) -> bool:
        """The on-region half of ``publish`` for a whole batch -- the layer bits (READY after
        the last layer) and the doorbells -- callable from any thread: the CUDA poller runs it
        the moment a put's DMA has landed, so that a consumer sees the layer while this node's
        event loop is busy or blocked (a prefill thread waiting in a CUDA synchronize, as
        sampling does). The bookkeeping half stays on the loop (``publish`` with
        ``region_done``). False when ``res`` is not a whole batch (any more): ``publish`` then
        does all of it, on the loop, as before.

        Safe against the loop's own changes because the batch's layer record and its ``whole``
        flag change only under ``FillBook.pub_lock``: a split (an abandon starts with one) either
        happens first -- then nothing is stored here -- or waits for this store, and evicts
        afterwards. The record is the batch's layers published so far, in the order their DMAs
        landed (the poller's order), so ``publish_layers_lines`` stores the right words from
        either thread."""
        if type(res) is not FillBatch:
            return False
        lo, hi = kvplan.layer_mask(self.layout, layer)
        with self.book.pub_lock:
            if not res.whole:
                return False
            res.layers_lo |= lo
            res.layers_hi |= hi
            waiting = db.publish_lines_and_look(
                self.mem, self.geo.entries_offset, res.slots, res.lines, res.layers_lo,
                res.layers_hi, self._all_lo, self._all_hi, self._db_off, self._db_nodes)
        if waiting:
            self.doorbell.ring(int(waiting), threadsafe=True)
        self.stats.early_publishes += 1
        return True

    def publish(self, keys: list[bytes], positions: list[int] | range, res: Reserved,
                layer: int | None, nbytes: int, *, region_done: bool = False) -> int:
        """Step 3 of a put, once the bytes of ``layer`` (all layers: None) of these
        reservations are in the region: set their layer bits; a block whose every layer is in
        becomes READY and leaves this node's bookkeeping. A reservation no longer ours (the
        put was abandoned meanwhile) is skipped. Returns how many blocks were published.
        ``region_done``: ``publish_early`` already stored this layer's bits for the batch."""
        if CP.ARMED:
            CP.hit("put.copied")
        lo, hi = kvplan.layer_mask(self.layout, layer)
        reserved = self.book.reserved
        if type(res) is FillBatch:
            if res.whole:                 # nothing split it meanwhile: the arrays serve
                if not region_done:
                    with self.book.pub_lock:
                        res.layers_lo |= lo
                        res.layers_hi |= hi
                        # the batch's record is what its entries hold (publish_layers_lines)
                        waiting = db.publish_lines_and_look(
                            self.mem, self.geo.entries_offset, res.slots, res.lines, res.layers_lo,
                            res.layers_hi, self._all_lo, self._all_hi, self._db_off,
                            self._db_nodes)
                    if waiting:
                        self.doorbell.ring(int(waiting))
                n = len(res)
                if layer is None or (res.layers_lo == self._all_lo
                                     and res.layers_hi == self._all_hi):
                    deque(map(reserved.__delitem__, res.keys), maxlen=0)
                    with self.book.pub_lock:
                        res.whole = False
                    self.stats.blocks_stored += n
                return self._published(layer, nbytes, n)
            res = res.members or []       # split meanwhile (an abandon?): key by key
        ks = keys if len(positions) == len(keys) else [keys[i] for i in positions]
        if list(map(reserved.get, ks)) != res:     # some abandoned meanwhile (the list compares
            live = [(i, r) for i, r in zip(positions, res)   # by identity first: C loops)
                    if reserved.get(keys[i]) is r]
            positions, res = [i for i, _ in live], [r for _, r in live]
            ks = [keys[i] for i in positions]
        if res:
            self._publish_slots(np.fromiter(map(_SLOT_OF, res), dtype=np.int64,
                                            count=len(res)), lo, hi)
        if layer is None:             # every layer written: all of them are READY now
            deque(map(reserved.__delitem__, ks), maxlen=0)
            self.stats.blocks_stored += len(res)
        else:
            all_lo, all_hi = self._all_lo, self._all_hi
            for k, r in zip(ks, res):
                r.layers_lo |= lo
                r.layers_hi |= hi
                if r.layers_lo == all_lo and r.layers_hi == all_hi:
                    del reserved[k]
                    self.stats.blocks_stored += 1
        return self._published(layer, nbytes, len(res))

    def _publish_slots(self, slots: np.ndarray, lo: int, hi: int) -> int:
        """Set layer bits ``lo``/``hi`` in the entries ``slots`` (READY once all are in),
        ringing the doorbell of any node waiting on this region; returns ``len(slots)``."""
        waiting = db.publish_and_look(self.mem, self.geo.entries_offset, slots, lo, hi,
                                      self._all_lo, self._all_hi, self._db_off, self._db_nodes)
        if waiting:
            self.doorbell.ring(int(waiting))
        return len(slots)

    def _published(self, layer: int | None, nbytes: int, n: int) -> int:
        """A publish's counters and after-steps; returns ``n``."""
        self.stats.puts += 1
        self.stats.bytes_put += nbytes
        reserved = self.book.reserved
        if not reserved:
            self.preclaimer.maybe_drained()
        if CP.ARMED and layer is not None and reserved:
            CP.hit("publish.layer")
        return n

    def evict_lru_locked(self, k: int, *, only_own: bool = False) -> int:
        """Evict up to ``k`` sampled-LRU victims, this node's own blocks first (``only_own``:
        no other node's), and free their payloads; how many (``Evictor.lru``). Under the lock."""
        return self.evictor.lru(k, only_own=only_own)

    async def abandon(self, keys: list[bytes]) -> None:
        """Evict this node's unfinished reservations of ``keys`` (after a failed or cancelled
        put, once none of its copies can still land): without the lock in its own lane (nobody
        else writes a RESERVED entry of a live producer), else under it (shielded: it completes
        when cancelled)."""
        mine = self.book.pop(keys)
        if not mine:
            return
        if self.reserver.lane_ready:
            if CP.ARMED:
                CP.hit("abandon.started")
            self.evictor.slots([r.slot for _, r in mine])
            return
        await asyncio.shield(self._abandon_locked(mine))

    async def _abandon_locked(self, mine: list[tuple[bytes, Reservation]]) -> None:
        await hold_lock(self.lock, self.stats, timeout=max(5.0, self.cfg.liveness_timeout_s * 4))
        try:
            if CP.ARMED:
                CP.hit("abandon.started")
            self.evictor.slots([r.slot for _, r in mine])
        finally:
            self.lock.release()

    async def evict(self, keys: list[bytes], *, timeout: float | None = None) -> int:
        """Evict the READY entries of ``keys`` (anyone's: an operator or test tool) and free
        their payloads; returns how many. Takes the global lock. A block still being filled
        (RESERVED) is never evicted while its producer lives: the producer would go on writing
        its layer bits and READY into an entry that meanwhile means another block."""
        words = keys_to_words(keys)
        if not (self.index.snapshot(words)[:, SNAP_STATE] == ix.READY).any():
            return 0
        await hold_lock(self.lock, self.stats, timeout)
        try:
            snap = self.index.snapshot(words)    # under the lock: READY entries cannot change
            slots = [int(r[SNAP_SLOT]) for r in snap.tolist()
                     if r[SNAP_SLOT] >= 0 and r[SNAP_STATE] == ix.READY]
            self.evictor.slots(slots)
        finally:
            self.lock.release()
        return len(slots)

    def get_fused(self, kb: KeyBatch, dst: int, tmpl: np.ndarray) -> np.ndarray | None:
        """A whole read of a few READY blocks into private memory at ``dst`` (``fused.get_blocks``:
        snapshot, bounds, copy by the plan template ``tmpl``, revalidation, in one kernel call),
        counted and touched as ``validate_read`` does. Returns the snapshot (this node's scratch:
        valid until its next fused call), or None when the step-by-step path must run (some
        block absent, not READY, or with payload bounds that do not fit; nothing copied:
        ``fused_snapshot`` says what it saw). Raises BlockEvicted (the output is not to be
        trusted), as ``validate_read``."""
        if self.pause_after_snapshot is not None:
            return None
        keys, words = kb.keys, kb.words
        n = len(keys)
        snap, ok = self._fsnap[:n], self._fok[:n]
        rd = self.reader
        bad = int(fused.get_blocks(self.mem, self._fp, self.index.tgeo, words, tmpl,
                                   np.uint64(dst), rd.validate_reads, snap, ok))
        if bad < 0:
            return None
        rd.count_read(keys, ok, bad, n * self.layout.block_bytes, snap[:, SNAP_SLOT],
                      snap[:, SNAP_VERSION], snap[:, SNAP_POFF])
        self.stats.fused_gets += 1
        return snap

    def fused_snapshot(self, n: int) -> np.ndarray:
        """A copy of what the last fused get of ``n`` keys snapshotted."""
        return self._fsnap[:n].copy()

    async def wait_ready(self, words: np.ndarray, snap: np.ndarray, layer: int | None,
                         timeout: float) -> np.ndarray:
        """Wait up to ``timeout`` until every key of ``words`` is present and has ``layer``
        (READY for None), from ``snap`` (``stores/readiness.py``); the last snapshot. Raises
        TransferTimeout."""
        return await self.waits.wait(words, snap, layer, timeout)

    async def wait_whole(self, words: np.ndarray, snap: np.ndarray, timeout: float) -> None:
        """Wait up to ``timeout`` until every key is READY (``stores/readiness.py``, from
        ``snap``). Returns when it is, or when a block seen has vanished (the read then reports
        the miss). Raises TransferTimeout."""
        await self.waits.wait(words, snap, None, timeout)

    EXPIRY_SCANS_PER_DEADLINE = 8
    """Transfer-mode maintenance looks for expired blocks this many times per
    ``transfer_deadline_s`` (at most once per maintenance round): a block nobody consumed is
    freed at most 1/8 of its deadline late, and a 30 s deadline costs one pass over the index
    every 3.75 s instead of every round (the pass holds the global lock: ~90 ms on a 32 GiB
    region before ``index.expired_transfer_slots``)."""

    def _expiry_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_expiry:
            return False
        self._next_expiry = now + self.cfg.transfer_deadline_s / self.EXPIRY_SCANS_PER_DEADLINE
        return True

    async def maintain(self, timeout: float) -> None:
        """Flush LRU touches, free expired transfer-only blocks, drain returned slots, reclaim
        dead nodes' chunks."""
        self.alloc.drain_returns()
        self.touches.flush()           # lock-free (index.py, "Touch")
        expired_possible = self.cfg.mode == "transfer" and self._expiry_due()
        asked = self.others_ask()
        dead = self.reclaims_dead() and self.alloc.dead_hold_chunks()
        if not expired_possible and not asked and not dead:
            return
        await hold_lock(self.lock, self.stats, timeout)
        try:
            if dead:
                self.lock.check_token()
                self.alloc.recover_locked(self.lock)
            if asked:
                self.reserver.give_chunks_locked()
            if expired_possible:
                hit = self.index.expired_transfer(time.time_ns())
                self.evictor.slots(hit.tolist())
                self.stats.expired += len(hit)
        finally:
            self.lock.release()

    def others_ask(self) -> bool:
        """Another node has asked for chunks and this node owns more than one
        (``ChunkGiver.others_ask``): maintenance then takes the lock to consider giving some."""
        return self.giver.others_ask()

    def on_reclaim(self, node_id: int, spans: list[tuple[int, int]]) -> None:
        """Allocator hook (under the lock): a dead node's chunks go away; so do their entries."""
        self.stats.reclaimed_entries += self.index.drop_spans_locked(spans)

    async def close(self, timeout: float) -> None:
        """Evict unfinished reservations and this node's blocks, return chunks."""
        t = self.consumer.task          # deferred frees of consumed blocks go first
        if t is not None and not t.done():
            await asyncio.wait([t], timeout=timeout)
        self.closing = True
        await hold_lock(self.lock, self.stats, timeout)
        try:
            self.drop_spares()
            self.evictor.slots(
                [x for v in self.book.in_flight()
                 for x in (v.slots.tolist() if type(v) is FillBatch else (v.slot,))])
            self.book.reserved.clear()
            table = self.index.scan()
            mine = np.flatnonzero(((table[:, 0] == ix.READY) | (table[:, 0] == ix.RESERVED))
                                  & ((table[:, 6] & 0xFFFF) == self.node_id))
            self.evictor.slots(mine.tolist())
        finally:
            self.lock.release()
        await self._deliver_returns(timeout)
        await self.alloc.close(self.lock, timeout=timeout)

    async def _deliver_returns(self, timeout: float) -> None:
        """Before the allocator closes: retry, for up to ``RETURN_WAIT_S`` (or ``timeout``),
        the returns of other nodes' slots that did not fit their owners' rings while the
        owners' maintenance drains them (every few heartbeats). Without the wait a consumer of
        many transfer-only blocks (480 on a 128-entry ring) dropped them at its close, and
        their owner could not release those chunks at its own (fsck: a leak awaiting
        reclaim). A return whose owner does not drain in time stays lost, as for a node that
        dies (``region/alloc.py``, "Death")."""
        deadline = time.monotonic() + min(RETURN_WAIT_S, timeout)
        while self.alloc.deliver_pending() and time.monotonic() < deadline:
            await asyncio.sleep(RETURN_RETRY_S)
