"""The one owner of a block's lifecycle in the region: reserve, fill, publish, read, touch, abandon.

Every KV byte that enters or leaves the region goes through this module's steps; the copy
back-ends (the CPU copy of ``stores/region.py``, the CUDA DMA of ``cuda/store.py``) only move
bytes between the addresses it hands out and the caller's tensors. The byte-level protocol is
the essay of ``region/index.py``; this is its asyncio face, deciding *when* to take the global
lock (once per reservation batch, and for maintenance) and keeping this node's bookkeeping.

A put::

    words = keys_to_words(keys); snap = blocks.snapshot_for_put(words)
    todo = await blocks.reserve(keys, words, snap, timeout)     # positions this put writes
    res = blocks.reservations(keys, todo)                        # their payload offsets
    ... copy layer(s) into [r.offset, +block_bytes) ...
    blocks.publish(keys, todo, res, layer)                       # layer bits, READY when whole
    # on any failure or cancellation, once no copy can still land: await blocks.abandon(keys)

A get::

    words, snap = await blocks.prepare_read(keys, layer, timeout)   # waits, checks bounds
    ... copy from snap[:, SNAP_POFF] (payload offsets) ...
    blocks.validate_read(keys, words, snap, nbytes)   # after the copy (or its DMA): else a miss
    await blocks.consume(keys, words, snap, layer)     # transfer-only mode

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
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections import deque
from itertools import repeat
from operator import attrgetter
from typing import Any, Callable

import numpy as np

import tract_kernels as K

from .. import crashpoints as CP
from ..config import EngineConfig
from ..errors import BlockEvicted, LockTimeout, NodeEvicted, RegionFull, TransferTimeout
from ..keys import keys_to_words
from ..region import Region
from ..region import cpumarks
from ..region.index import (SNAP_COLS, SNAP_FLAGS, SNAP_NBYTES, SNAP_POFF, SNAP_SLOT, SNAP_STATE,
                           SNAP_VERSION)
from ..region import index as ix
from ..region.layout import INDEX_FLAG_NS_MASK as NS_MASK, INDEX_FLAG_NS_SHIFT as NS_SHIFT
from ..region.namespaces import ns_flags
from ..region.alloc import (A_CHUNK, A_GEN, A_NBYTES, A_OFFSET, A_OWNER, A_TOKEN, Allocation,
                            Allocator, allocation_rows, allocations_of_rows)
from ..region.chunks import alloc_geometry
from ..sync.lock import GlobalLock
from . import doorbell as db
from .chunkgive import ChunkGiver
from .eviction import Evictor
from .spares import SPARE_SLOTS, Spares, alloc_info
from .touches import TouchLog
from . import fused
from . import plan as kvplan
from . import waits
from .layouts import LayoutGuard
from .snapcheck import rows_fine
from .preclaim import PreClaimer
from .readiness import SMALL_READ, ReadyWaits, check_available, rows_available
from .stats import TransferStats

EVICT_AHEAD = 64
"""When a locked reservation evicts for space, it evicts up to this many blocks (at least 16,
at most the put's size) beyond its need, so that the puts after it find free slots and reserve
without the lock: in a full prefix cache, one put in ~16-64 takes the lock instead of every one.
The cost is that many blocks' worth of capacity, per node, held free."""

CHUNK_WAIT_S = 2.0
"""How long a put that found no chunk waits for an owner to release one (its ask recorded)."""

RETURN_WAIT_S = 2.0
"""How long a closing node retries returns that did not fit their owners' rings
(``_deliver_returns``)."""
RETURN_RETRY_S = 0.01

OPTIMISTIC_MIN_KEYS = 64
"""A put of at least this many keys may skip its index snapshot (``snapshot_for_put``)."""

class _Starving(RegionFull):
    """No chunk to allocate from; this node's ask for some is recorded (internal: a put
    waits for an owner to release one, then raises RegionFull)."""


_SLOT_OF = attrgetter("slot")
_OFFSET_OF = attrgetter("offset")


KNOWN_ROWS = 8
"""Layer reads whose slots ``prepare_read`` remembers (a few requests decoding at once)."""


class FillBatch:
    """The blocks one ``_place`` call reserved, as arrays: while they are filled layer by
    layer, every one of their keys maps to this object in ``BlockLifecycle._reserved`` (it
    stands for all of them) and it is the handle ``reservations`` and ``filling`` return for a
    transfer of exactly its keys, in order.

    Why. A put of n new blocks used to make n ``Reservation`` objects under its reservation
    (0.15 µs each on the 2-core VM: 308 µs of a 2048-block put's ~1.3 ms ``_place``, and 2-3x
    that on the H200 host, where the first layer of a layer-streamed 128 MiB handoff waits for
    it), and each later layer put looked each one up and compared it (``filling``, ``publish``:
    ~100 µs a 2048-block layer). The arrays serve the common shape -- every layer put for the
    same keys in the same order -- with one list comparison per layer.

    Any other shape (a subset of the keys, another order, an abandon, an undo) first *splits*
    the batch (``BlockLifecycle._split``): a ``Reservation`` per key, with the layers published
    so far, replaces the batch in ``_reserved``; ``members`` keeps them in key order and
    ``whole`` turns False, so the arrays never serve again. A transfer holding the batch as its
    handle while that happened (a copy in flight when another task abandoned some of its keys)
    then publishes through ``members``, key by key, as for any list of reservations."""
    __slots__ = ("keys", "slots", "versions", "offsets", "chunks", "layers_lo", "layers_hi",
                 "whole", "members")

    def __init__(self, keys: list[bytes], slots: np.ndarray, versions: np.ndarray,
                 offsets: np.ndarray, chunks: np.ndarray) -> None:
        self.keys = keys
        self.slots = slots
        self.versions = versions
        self.offsets = offsets
        self.chunks = chunks
        self.layers_lo = 0
        self.layers_hi = 0
        self.whole = True
        """Every key of ``keys`` maps to this batch in ``_reserved`` (until a split or the
        publish of its last layer)."""
        self.members: list["Reservation"] | None = None
        """The reservations a split made, in key order (None before a split)."""

    def __len__(self) -> int:
        return len(self.keys)


class Reservation:
    """A block this node reserved and is filling, layer by layer, apart from any batch: its
    index entry (``slot``, ``version``), its payload (``offset``: bytes from the region base, in
    chunk ``chunk``), and the layers published so far. (A slotted class; a large put's blocks
    are a ``FillBatch`` instead. It keeps the payload's place, not its ``Allocation``: a
    reservation is undone through its index entry, whose payload words say what to free.)"""
    __slots__ = ("slot", "version", "offset", "chunk", "layers_lo", "layers_hi")

    def __init__(self, slot: int, version: int, offset: int, chunk: int, layers_lo: int = 0,
                 layers_hi: int = 0) -> None:
        self.slot = slot
        self.version = version
        self.offset = offset
        self.chunk = chunk
        self.layers_lo = layers_lo
        self.layers_hi = layers_hi


Reserved = FillBatch | list[Reservation]
"""What ``reservations`` and ``filling`` return and ``payload_offsets`` / ``publish`` take:
a whole batch, or one reservation per position."""


@dataclasses.dataclass
class StoreStats(TransferStats):
    """The region store's counters: the shared ones plus recovery and global-lock figures."""
    reclaimed_entries: int = 0
    stale_entries_dropped: int = 0
    """Evicted entries whose slot had been handed to another reservation (index and allocator
    disagreed): dropped without freeing the slot, which is not theirs."""
    full_without_chunk: int = 0
    """Puts refused at once: no chunk of this node's to make room in, none free to claim."""
    evictions_for_others: int = 0
    """Blocks evicted to release a chunk to a node that asked for one."""
    chunks_given: int = 0
    """Chunks released for nodes that asked (``alloc.py``, "Starving")."""
    lock_acquisitions: int = 0
    lock_wait_s: float = 0.0
    deferred_consume_failures: int = 0
    """Consumed blocks a deferred free (``defer_consume``) could not free: the lock could not
    be had; their transfer deadline frees them."""
    lockfree_reservations: int = 0
    """Reservation batches placed without the global lock (index.py, "Who writes what")."""
    fused_puts: int = 0
    """Puts done in one kernel call (``put_fused``), a subset of ``lockfree_reservations``."""
    fused_gets: int = 0
    """Gets done in one kernel call (``get_fused``)."""
    small_puts: int = 0
    """Fused puts that came by the Engine's one-block fast path (``stores/small.py``)."""
    small_gets: int = 0
    """Fused gets that came by that path."""
    spin_wakes: int = 0
    """Waits that the brief spin on the loop's thread satisfied
    (``readiness.ReadyWaits._spin_on_loop``)."""
    preclaimed_chunks: int = 0
    """Chunks claimed ahead of need by the pre-claim task (module docstring)."""
    evicted_ahead: int = 0
    """This node's blocks evicted ahead of need by the pre-claim task, in a full region
    (``stores/preclaim.py``, "Evicting ahead"); also counted in ``evictions``."""
    unsnapshotted_puts: int = 0
    """Puts (or stages of one) that reserved without an index snapshot (``snapshot_for_put``)."""
    parallel_reads: int = 0
    """Reads done in parallel groups, metadata included (``stores/parallel.py``)."""
    parallel_reads_redone: int = 0
    """Parallel reads that a group sent to the step-by-step path (not ready, changed)."""
    parallel_read_groups: int = 0
    """Groups of parallel reads (the loop's own included)."""
    early_publishes: int = 0
    """Layer publishes stored by the CUDA poller's thread as the DMA landed (``publish_early``),
    before the loop's bookkeeping."""
    known_slot_reads: int = 0
    """Layer reads that took the slots of the previous layer's read of the same keys (layer
    bits re-read at those slots, no lookup: ``prepare_read``)."""
    doorbell_wakes: int = 0
    """Waits that a producer's doorbell woke (the rest found their block on a timer's look,
    or polled: ``stores/doorbell.py``)."""
    doorbell_probe_skips: int = 0
    """Doorbell rings a waiting read answered with one key's lookup instead of a look at every
    key (``readiness.ReadyWaits._on_doorbell``: its probe key was still missing)."""


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
        index.meta_threads = ix.auto_meta_threads(waits.usable_cpus(),
                                                  region.mem[K.MEM_BACKEND] == K.BACKEND_HW)
        """How long a same-host wait spins before it sleeps (``readiness.ReadyWaits``)."""
        self.stats = StoreStats()
        self._reserved: dict[bytes, Reservation | FillBatch] = {}
        """This node's blocks in flight: each key's reservation, or the batch that holds it."""
        self.touches = TouchLog(region, self.geo.entries_offset)
        """Reads recorded for the approximate LRU (``stores/touches.py``)."""
        self._consumed_layers: dict[bytes, int] = {}  # transfer mode: layers read so far
        self._asked = False                           # our ask for chunks is recorded
        self._lockfree = index.lockfree_for(region.max_nodes)
        """A lane per node id: this node reserves and abandons in its lane without the lock."""
        self.lane = self.node_id if self._lockfree else 0
        self._lane_off = index.lane_counters_offset(self.lane)
        self.evictor = Evictor(region, index, allocator, self.layout, self.stats,
                               lane=self.lane, node_id=self.node_id)
        """Tombstones entries and frees their payloads (``stores/eviction.py``)."""
        self._lane_taken = not self._lockfree          # one lane for all: nothing to take over
        self._lane_ready = False
        """Set at this incarnation's first hold of the lock, once it has taken its lane over
        (``clear_lane``); only then does it write the lane without the lock."""
        self.pause_after_snapshot: Any = None
        """Test seam: an awaitable factory a copy back-end runs between a read's snapshot and
        its copy, so a test can evict and rewrite the block exactly there (deterministic
        torn-read control)."""
        self.validate_reads = True
        """Re-validate versions after each copy (invariant 6). Only the torn-read stress test's
        negative control turns this off, to show that without it wrong bytes get through."""
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
        self._read_words: tuple[list[bytes], list[bytes], np.ndarray] | None = None
        self._read_rows: list[tuple[list[bytes], np.ndarray]] = []
        """The last ``KNOWN_ROWS`` layer reads of more than ``SMALL_READ`` blocks that found
        every block, newest first: a copy of the key list and the snapshot (``prepare_read``'s
        known-slot path). Found by content (a list comparison: identity per key first), not by
        the list's identity: a decode worker's requests interleave, and each operation's
        checked key list is a new one once another list was checked in between."""
        """``read_words``' cache: the key list last read, a copy of its keys, their words."""
        self._puts_fresh = True
        """The last ``reserve`` found none of its keys present (``snapshot_for_put``)."""
        self._placed = 0
        """Blocks the last successful ``_place`` reserved (``reserve``: all placed, no per-key
        look)."""
        self.closing = False
        self._next_expiry = 0.0         # monotonic time of the next expiry pass (maintain)
        self._consume_pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._consume_task: asyncio.Task[None] | None = None   # defer_consume's drain
        """Set by ``close``: the pre-claim task claims nothing after it."""
        self._pub_lock = threading.Lock()
        """Guards a FillBatch's layer record and ``whole`` flag against ``publish_early``
        (another thread); see there."""
        self._cpu_marks: cpumarks.CpuMarks | None = None
        """``cpu_marks``, once made."""
        self.reclaims_dead: Callable[[], bool] = lambda: True
        """Whether this node's maintenance reclaims dead nodes' chunks (``maintain``): the
        Engine makes it the node that hosts the lock manager, one janitor per rack instead of
        every node taking the lock for the same reclaim."""
        self.ns_tag = 0
        """This node's namespace tag (``stores/layouts.py``), carried in the ``flags`` of the
        entries it reserves; 0 until the Engine records its namespace (``use_layouts``)."""
        self.layouts: LayoutGuard | None = None
        """The read-side check of the blocks' namespaces; None: not checked (no Engine)."""
        self._entry_flags = ix.FLAG_TRANSFER if cfg.mode == "transfer" else 0
        """The ``flags`` word of the entries this node reserves."""
        self._fp = self._fused_params()
        self._fres = np.zeros((fused.FUSED_MAX_BLOCKS, 3), dtype=np.int64)
        self._fsnap = np.zeros((fused.FUSED_MAX_BLOCKS, SNAP_COLS), dtype=np.int64)
        self._fok = np.zeros(fused.FUSED_MAX_BLOCKS, dtype=np.bool_)

    def use_layouts(self, guard: LayoutGuard) -> None:
        """From now on reserve entries under ``guard``'s namespace tag and check the namespace
        of every block a read finds (``stores/layouts.py``). Before the first put."""
        self.layouts = guard
        self.ns_tag = guard.tag
        self._entry_flags = (self._entry_flags & ix.FLAG_TRANSFER) | ns_flags(guard.tag)
        self._fp[fused.P_FLAGS] = self._entry_flags
        self._fp[fused.P_NS_TAG] = guard.tag

    def _fused_params(self) -> np.ndarray:
        """The constant arguments of the fused kernels (``fused.P_*``) for this node."""
        g, ag = self.geo, self.ageo
        p = np.zeros(fused.P_FIELDS, dtype=np.int64)
        p[fused.P_LOFF] = self._lane_off
        p[fused.P_EOFF] = g.entries_offset
        p[fused.P_MASK] = self.index.mask
        p[fused.P_MAX_PROBE] = g.max_probe
        p[fused.P_LANES] = g.lanes
        p[fused.P_LANE] = self.lane
        p[fused.P_PRODUCER] = self.node_id
        p[fused.P_FLAGS] = self._entry_flags
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
        return len(self._reserved)

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
        t0 = time.perf_counter()
        try:
            await self.lock.acquire(timeout=timeout)
        except LockTimeout as e:
            raise TransferTimeout(f"global lock not granted within {timeout} s "
                                  f"({self.lock.statistics()})") from e
        self.stats.lock_acquisitions += 1
        self.stats.lock_wait_s += time.perf_counter() - t0

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """Leading keys resident and complete (lock-free)."""
        if not keys:
            return 0
        return self.index.lookup(keys_to_words(keys))

    def read_words(self, keys: list[bytes]) -> np.ndarray:
        """``keys_to_words(keys)`` for a read, from a one-entry cache when ``keys`` is the list
        the last large read got, with the same keys in it (one C-level list comparison): a
        layer-streamed get reads the same keys once per layer, and their words cost ~60 µs per
        2048 keys on the 2-core VM. The cached array is only ever read (by the kernels)."""
        c = self._read_words
        if c is not None and c[0] is keys and c[1] == keys:
            return c[2]
        words = keys_to_words(keys)
        if len(keys) > SMALL_READ:
            self._read_words = (keys, list(keys), words)
        return words

    def snapshot(self, words: np.ndarray) -> np.ndarray:
        """The index rows of ``words`` (``PrefixIndex.snapshot``), lock-free."""
        return self.index.snapshot(words)

    def snapshot_for_put(self, words: np.ndarray) -> np.ndarray:
        """What a put's ``reserve`` starts from: the index rows of ``words``, or -- for a put of
        at least ``OPTIMISTIC_MIN_KEYS`` keys while this node's last put found none of its keys
        present (``_puts_fresh``) -- rows that say every key is absent, without reading the
        index.

        Why. The snapshot only sorts present keys out before slots are allocated for the rest;
        the reservation kernel probes every key's window anyway and skips a key it finds live
        (``index.reserve_batch``: ``-(2 + slot)``; its slot goes back to the free list). A
        layer-streamed handoff or a prefill's new blocks put fresh keys every time, and a
        cache's caller looks its prefix up before it puts, so the snapshot mostly reads what
        the kernel reads again: 0.2-0.3 µs a key on the 2-core VM, 363-440 µs of a 2048-block
        put's ~1.5 ms reservation. A put that does find present keys costs their slots' take
        and give-back (a few µs), and the next put snapshots again."""
        n = words.shape[0]
        if n >= OPTIMISTIC_MIN_KEYS and self._puts_fresh:
            self.stats.unsnapshotted_puts += 1
            return np.full((n, SNAP_COLS), -1, dtype=np.int64)
        return self.index.snapshot(words)

    # -- put ----------------------------------------------------------------------------------
    async def reserve(self, keys: list[bytes], words: np.ndarray, snap: np.ndarray,
                              timeout: float | None) -> list[int]:
        """Step 1 of a put: the positions of ``keys`` it writes, ascending -- blocks this node
        is already filling (an earlier layer's put), plus those absent from the index (``snap``
        from ``snapshot``), reserved now under one hold of the global lock. Present blocks
        (anyone's) are skipped and counted. Raises RegionFull (nothing reserved: all or
        nothing), TransferTimeout (lock), NodeEvicted."""
        todo: list[int] = []          # positions in keys this call writes
        new: list[int] = []           # positions that need a reservation
        reserved = self._reserved
        skipped = self.stats.blocks_skipped
        if not reserved and len(keys) > SMALL_READ:    # none of ours in flight: one numpy pass
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
            await self._reserve_or_wait(keys, words, new, timeout)
            got = (new if self._placed == len(new) else      # all placed: no per-key look
                   [i for i in new if keys[i] in reserved])
            todo = sorted(set(todo).union(got)) if todo else got
        self._puts_fresh = self.stats.blocks_skipped == skipped   # ``snapshot_for_put``
        return todo

    def filling(self, keys: list[bytes]) -> Reserved | None:
        """This node's reservations of ``keys``, in order, when each key is a block this node
        is filling (reserved by an earlier layer's put, not yet READY): what ``reserve`` and
        ``reservations`` would give for them, found without the index snapshot (and the key
        words) they need for other keys -- the whole ``FillBatch`` when ``keys`` are exactly
        its keys (one list comparison). None otherwise."""
        reserved = self._reserved
        if not keys or len(reserved) < len(keys):
            return None
        whole = self._batch_of(keys)
        if whole is not None:
            return whole
        try:
            return self._as_reservations(keys, list(map(reserved.__getitem__, keys)))
        except KeyError:
            return None

    def _batch_of(self, keys: list[bytes]) -> FillBatch | None:
        """The whole FillBatch whose keys are exactly ``keys`` (same order), or None."""
        b = self._reserved.get(keys[0])
        if type(b) is FillBatch and b.whole and (b.keys is keys or b.keys == keys):
            return b
        return None

    def _as_reservations(self, keys: list[bytes], vals: list[Any]) -> list[Reservation]:
        """``vals`` (the ``_reserved`` values of ``keys``) as one Reservation per key: any
        batch among them is split first (``FillBatch``). A C-level type scan when none is."""
        if FillBatch not in map(type, vals):
            return vals
        self._split_keys(keys)
        return list(map(self._reserved.__getitem__, keys))

    def _split_keys(self, keys: list[bytes]) -> None:
        """Split every FillBatch that one of ``keys`` maps to (``FillBatch``: a Reservation per
        key, with the layers published so far, replaces it)."""
        reserved = self._reserved
        seen: dict[int, FillBatch] = {}
        for k in keys:
            v = reserved.get(k)
            if type(v) is FillBatch:
                seen[id(v)] = v
        for b in seen.values():
            with self._pub_lock:          # its layers are final while ``publish_early`` waits
                if not b.whole:
                    continue
                members = list(map(Reservation, b.slots.tolist(), b.versions.tolist(),
                                   b.offsets.tolist(), b.chunks.tolist(), repeat(b.layers_lo),
                                   repeat(b.layers_hi)))
                reserved.update(zip(b.keys, members))
                b.members = members
                b.whole = False

    def _in_flight(self) -> list[Reservation | FillBatch]:
        """The distinct values of ``_reserved`` (a batch once, however many keys it holds)."""
        return list({id(v): v for v in self._reserved.values()}.values())

    async def _reserve_or_wait(self, keys: list[bytes], words: np.ndarray,
                               positions: list[int], timeout: float | None) -> None:
        """``_reserve``; when it starves for chunks (its ask recorded), wait -- up to
        ``CHUNK_WAIT_S`` or the put's timeout -- for an owner to release one, then retry."""
        wait_s = CHUNK_WAIT_S if timeout is None else min(CHUNK_WAIT_S, timeout)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await self._reserve(keys, words, positions, timeout)
                return
            except _Starving as e:
                self._asked = True
                if time.monotonic() >= deadline:
                    raise RegionFull(f"{e}; none came free within {wait_s:.1f} s (owners "
                                     f"release chunks beyond their fair share when they next "
                                     f"hold the lock)") from None
            table = self.alloc.table
            while time.monotonic() < deadline and table.find_free() is None:
                await asyncio.sleep(0.005)

    async def _reserve(self, keys: list[bytes], words: np.ndarray, positions: list[int],
                       timeout: float | None) -> None:
        """Reserve entries and payload for ``positions``: without the global lock when this node
        has a lane of its own and its free slots suffice (``_reserve_lockfree``), else under one
        hold of the lock (``_reserve_locked``)."""
        pc = self.preclaimer
        pc.put_started()
        have = self.spares.take(len(positions))
        if self._lane_ready:
            done, have = self._reserve_lockfree(keys, words, positions, have)
            if done:
                pc.note_put(len(positions))
                return
        with pc.reserving():            # waiting for the lock is not idle
            await self._reserve_locked(keys, words, positions, timeout, have)
        pc.note_put(len(positions))

    def _reserve_lockfree(self, keys: list[bytes], words: np.ndarray, positions: list[int],
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
        return self._place(keys, words, positions, allocs) is None, []

    # -- spares and the fused put -------------------------------------------------------------
    def drop_spares(self) -> None:
        """Give every spare slot back to the free lists (before chunks are released)."""
        self.spares.drop()

    def put_fused(self, keys: list[bytes], words: np.ndarray, src: int,
                  tmpl: np.ndarray) -> int | None:
        """A whole put of a few whole blocks (``fused.put_blocks``: reservation in this node's
        lane, copy from private memory at ``src`` by the plan template ``tmpl``, publish, in one
        kernel call); returns the blocks stored, or None when this put needs the step-by-step
        path (nothing then changed): the lane not yet taken over, a crash test armed, a key of
        this node in flight, too few free slots without the lock, a probe window without a
        free entry of the lane, or a look at other nodes' asks due. Raises NodeEvicted."""
        n = len(keys)
        if (not self._lane_ready or CP.ARMED
                or (self._reserved and any(k in self._reserved for k in keys))
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
            # take back what it reserved, newest first (as ``_undo``: an entry that was EMPTY
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

    async def _reserve_locked(self, keys: list[bytes], words: np.ndarray, positions: list[int],
                              timeout: float | None, have: list[Allocation] | None = None
                              ) -> None:
        """Reserve under one hold of the global lock: allocation with chunk claims and LRU
        eviction (``_alloc_many_locked``), and, where a key's probe window holds no free entry
        of this node's lane, the eviction of this lane's oldest entry there. ``have``: slots
        already allocated for this batch (freed here on any failure)."""
        try:
            await self.hold_lock(timeout)
        except BaseException:
            if have:
                self.alloc.free_many(have)
            raise
        try:
            if CP.ARMED:
                CP.hit("reserve.locked")
            self.lock.check_token()
            if not self._lane_taken:
                # this incarnation's first hold: take the lane over from any predecessor
                self.stats.reclaimed_entries += self.index.clear_lane_locked(self.lane)
                self._lane_taken = True
                self._lane_ready = self._lockfree
            self.touches.flush()
            if self.giver.due():
                self._give_chunks_locked()
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
                full = self._place(keys, words, positions, allocs)
                if full is None:
                    return
                if attempt or not self.evictor.windows(words[np.asarray(full)]):
                    raise RegionFull(
                        f"index probe window of {self.geo.max_probe} groups holds no free "
                        f"entry of node {self.node_id}'s lane, and none of its blocks there can "
                        f"be evicted (capacity {self.geo.capacity}, {self.geo.lanes} lanes); "
                        f"create the region with a larger index (EngineConfig.index_capacity)")
        finally:
            self.lock.release()

    def _place(self, keys: list[bytes], words: np.ndarray, positions: list[int],
               allocs: list[Allocation] | np.ndarray) -> list[int] | None:
        """Index entries in this node's lane for ``positions``, with payloads ``allocs`` (a
        list, or ``allocation_rows``; freed here when not used): None when placed (keys found
        live meanwhile are skipped), else the positions whose probe window had no free entry --
        and then nothing is reserved (all or nothing: the region is as it was). Lock-free with
        a lane per node; else the caller holds the lock."""
        mine: list[tuple[bytes, int]] = []
        fast: tuple[list[bytes], np.ndarray] | None = None   # all reserved: (keys, previous)
        self._placed = 0
        if isinstance(allocs, np.ndarray) and len(allocs) > 1:
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
            flags = self._entry_flags
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
            try:
                # one kernel call: the reservation, then (all reserved) the publishes counter
                counted = ix.reserve_batch_counted(
                    self.mem, self._lane_off, g.entries_offset, self.index.tgeo,
                    self.index.mask, g.max_probe, g.lanes, self.lane,
                    words if len(positions) == len(keys) else
                    words[np.asarray(positions, dtype=np.int64)], ainfo, now, producer, flags,
                    deadline, res)
            except BaseException:
                self._free_allocs(allocs)
                raise
            full: list[int] = []
            unused: list[int] = []
            reserved = self._reserved
            if len(positions) > SMALL_READ and (res[:, 0] >= 0).all():  # all reserved: a batch
                ks = keys if len(positions) == len(keys) else [keys[i] for i in positions]
                batch = FillBatch(ks, res[:, 0].copy(), res[:, 2].copy(),
                                  offs_np if offs_np is not None else
                                  np.asarray(offs, dtype=np.int64),
                                  chunks_np if chunks_np is not None else
                                  np.asarray(chunks, dtype=np.int64))
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
            self._placed = placed
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
        self._split_keys([k for k, _ in mine])
        for state in (ix.EMPTY, ix.TOMBSTONE):
            back = [self._reserved.pop(k).slot for k, prev in reversed(mine) if prev == state]
            self.evictor.slots(back, count=False, new_state=state)
        mine.clear()

    def reservations(self, keys: list[bytes], positions: list[int]) -> Reserved:
        """This node's reservations of ``keys[i]`` for ``i`` in ``positions`` (from ``reserve``):
        the whole FillBatch when they are exactly its keys, else one Reservation each."""
        reserved = self._reserved
        if len(positions) == len(keys):     # every key (positions ascend)
            whole = self._batch_of(keys) if keys else None
            if whole is not None:
                return whole
            return self._as_reservations(keys, list(map(reserved.__getitem__, keys)))
        ks = [keys[i] for i in positions]
        return self._as_reservations(ks, list(map(reserved.__getitem__, ks)))

    @staticmethod
    def payload_offsets(res: Reserved) -> np.ndarray:
        """int64 payload offsets of ``res``, in order."""
        if type(res) is FillBatch:
            return res.offsets
        return np.fromiter(map(_OFFSET_OF, res), dtype=np.int64, count=len(res))

    def publish_early(self, res: Reserved, layer: int | None) -> bool:
        """The on-region half of ``publish`` for a whole batch -- the layer bits (READY after
        the last layer) and the doorbells -- callable from any thread: the CUDA poller runs it
        the moment a put's DMA has landed, so that a consumer sees the layer while this node's
        event loop is busy or blocked (a prefill thread waiting in a CUDA synchronize, as
        sampling does). The bookkeeping half stays on the loop (``publish`` with
        ``region_done``). False when ``res`` is not a whole batch (any more): ``publish`` then
        does all of it, on the loop, as before.

        Safe against the loop's own changes because the batch's layer record and its ``whole``
        flag change only under ``_pub_lock``: a split (an abandon starts with one) either
        happens first -- then nothing is stored here -- or waits for this store, and evicts
        afterwards. The record is the batch's layers published so far, in the order their DMAs
        landed (the poller's order), so ``publish_layers_known`` stores the right words from
        either thread."""
        if type(res) is not FillBatch:
            return False
        lo, hi = kvplan.layer_mask(self.layout, layer)
        with self._pub_lock:
            if not res.whole:
                return False
            res.layers_lo |= lo
            res.layers_hi |= hi
            waiting = db.publish_known_and_look(
                self.mem, self.geo.entries_offset, res.slots, res.layers_lo,
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
        reserved = self._reserved
        if type(res) is FillBatch:
            if res.whole:                 # nothing split it meanwhile: the arrays serve
                if not region_done:
                    with self._pub_lock:
                        res.layers_lo |= lo
                        res.layers_hi |= hi
                        # the batch's record is what its entries hold (publish_layers_known)
                        waiting = db.publish_known_and_look(
                            self.mem, self.geo.entries_offset, res.slots, res.layers_lo,
                            res.layers_hi, self._all_lo, self._all_hi, self._db_off,
                            self._db_nodes)
                    if waiting:
                        self.doorbell.ring(int(waiting))
                n = len(res)
                if layer is None or (res.layers_lo == self._all_lo
                                     and res.layers_hi == self._all_hi):
                    deque(map(reserved.__delitem__, res.keys), maxlen=0)
                    with self._pub_lock:
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
        reserved = self._reserved
        if not reserved:
            self.preclaimer.maybe_drained()
        if CP.ARMED and layer is not None and reserved:
            CP.hit("publish.layer")
        return n

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
                ahead = min(EVICT_AHEAD, max(count, 16)) if self._lockfree else 0
                got = self.evict_lru_locked(min(need + ahead, budget)) if budget > 0 else 0
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
        if self._asked:
            table.set_wanted(self.node_id, 0)
            self._asked = False
        if not parts:
            return allocation_rows([])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _give_chunks_locked(self) -> int:
        """Release chunks to nodes that asked for some, none with a put of ours in flight
        (``stores/chunkgive.py``); how many. Caller holds the lock."""
        return self.giver.give_locked(self._busy_chunks)

    def _busy_chunks(self) -> set[int]:
        """The chunks of this node's puts in flight."""
        busy: set[int] = set()
        for v in self._in_flight():
            busy.update(v.chunks.tolist() if type(v) is FillBatch else (v.chunk,))
        return busy

    def evict_lru_locked(self, k: int, *, only_own: bool = False) -> int:
        """Evict up to ``k`` sampled-LRU victims, this node's own blocks first (``only_own``:
        no other node's), and free their payloads; how many (``Evictor.lru``). Under the lock."""
        return self.evictor.lru(k, only_own=only_own)

    async def abandon(self, keys: list[bytes]) -> None:
        """Evict this node's unfinished reservations of ``keys`` (after a failed or cancelled
        put, once none of its copies can still land): without the lock in its own lane (nobody
        else writes a RESERVED entry of a live producer), else under it (shielded: it completes
        when cancelled)."""
        self._split_keys(keys)
        mine = [(k, self._reserved.pop(k)) for k in keys if k in self._reserved]
        if not mine:
            return
        if self._lane_ready:
            if CP.ARMED:
                CP.hit("abandon.started")
            self.evictor.slots([r.slot for _, r in mine])
            return
        await asyncio.shield(self._abandon_locked(mine))

    async def _abandon_locked(self, mine: list[tuple[bytes, Reservation]]) -> None:
        await self.hold_lock(timeout=max(5.0, self.cfg.liveness_timeout_s * 4))
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
        await self.hold_lock(timeout)
        try:
            snap = self.index.snapshot(words)    # under the lock: READY entries cannot change
            slots = [int(r[SNAP_SLOT]) for r in snap.tolist()
                     if r[SNAP_SLOT] >= 0 and r[SNAP_STATE] == ix.READY]
            self.evictor.slots(slots)
        finally:
            self.lock.release()
        return len(slots)

    # -- get ----------------------------------------------------------------------------------
    async def prepare_read(self, keys: list[bytes], layer: int | None,
                           timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-2 of a lock-free read (index.py): snapshot the entries (waiting up to
        ``timeout`` for blocks or the layer), check state and payload bounds. Returns the key
        words and the snapshot (rows: slot, version, state, payload offset, nbytes, layer bits,
        flags), which ``validate_read`` takes after the copy. Raises BlockNotFound,
        LayerNotReady, TransferTimeout, BlockEvicted, LayoutMismatch (a block of a namespace
        of another layout: ``stores/layouts.py``)."""
        self.preclaimer.read_started()
        words = self.read_words(keys)
        g = self.ageo
        end = g.chunks_offset + g.nchunks * g.chunk_bytes
        known = self._known_rows(keys) if layer is not None else None
        if known is not None:
            # a later layer of blocks read recently (a layer-streamed get): their entries'
            # layer bits afresh at the slots found then, a line a block, instead of a lookup
            # per block (whatever changed since is caught by this read's revalidation: see
            # ``PrefixIndex.refresh_layers``); anything not fine takes the whole path below
            snap = known.copy()
            self.index.refresh_layers(snap)
            lay = self.layouts
            tag, mask = (lay.tag, NS_MASK) if lay is not None else (0, 0)
            if rows_fine(snap, layer, self.layout.block_bytes, g.chunks_offset, end, tag,
                         NS_SHIFT, mask):
                self.stats.known_slot_reads += 1
                return words, snap
        if timeout is not None and timeout > 0:
            snap = await self.waits.wait(words, self.waits.first_look(words, layer), layer,
                                         timeout)
        else:
            snap = self.index.snapshot(words)
        if snap.shape[0] <= SMALL_READ:
            # a few blocks: the same checks on Python ints (each numpy op below costs ~1 µs; a
            # one-block layer read through numpy cost ~22 µs on the 2-core VM, ~4 µs this way)
            rows = snap.tolist()
            bb, lo = self.layout.block_bytes, g.chunks_offset
            if rows_available(rows, layer):
                if self.layouts is not None:       # before the bounds: another layout's block
                    self.layouts.check_rows(keys, rows)         # has other bounds too
                for i, r in enumerate(rows):
                    poff, nb = r[SNAP_POFF], r[SNAP_NBYTES]
                    if nb != bb or poff < lo or poff + nb > end:
                        self.stats.validation_failures += 1
                        raise BlockEvicted(f"block {i} ({keys[i][:8].hex()}…) has payload "
                                           f"bounds [{poff}, +{nb}) that do not fit this "
                                           f"layout: changed during the read; treat as a miss")
                return words, snap
        lay = self.layouts
        tag, mask = (lay.tag, NS_MASK) if lay is not None else (0, 0)
        if rows_fine(snap, -1 if layer is None else layer, self.layout.block_bytes,
                     g.chunks_offset, end, tag, NS_SHIFT, mask):
            if layer is not None:           # the next layer may take the known slots
                self._remember_rows(keys, snap)
            return words, snap              # the common case in one pass (stores/snapcheck.py)
        check_available(keys, snap, layer, self.stats)
        if self.layouts is not None:
            self.layouts.check_snapshot(keys, snap)
        bad = np.flatnonzero((snap[:, SNAP_NBYTES] != self.layout.block_bytes) | (snap[:, SNAP_POFF] < g.chunks_offset)
                             | (snap[:, SNAP_POFF] > end - self.layout.block_bytes))  # no wrap
        if bad.size:
            i = int(bad[0])
            self.stats.validation_failures += 1
            raise BlockEvicted(f"block {i} ({keys[i][:8].hex()}…) has payload bounds "
                               f"[{snap[i, SNAP_POFF]}, +{snap[i, SNAP_NBYTES]}) that do not fit this layout: "
                               f"changed during the read; treat as a miss")
        return words, snap

    def _known_rows(self, keys: list[bytes]) -> np.ndarray | None:
        """The remembered snapshot of exactly ``keys`` (``_read_rows``), or None."""
        n = len(keys)
        for ks, snap in self._read_rows:
            if len(ks) == n and ks[0] is keys[0] and ks == keys:
                return snap
        return None

    def _remember_rows(self, keys: list[bytes], snap: np.ndarray) -> None:
        rows = [e for e in self._read_rows if not (len(e[0]) == len(keys) and e[0] == keys)]
        rows.insert(0, (list(keys), snap.copy()))
        del rows[KNOWN_ROWS:]
        self._read_rows = rows

    def get_fused(self, keys: list[bytes], words: np.ndarray, dst: int,
                  tmpl: np.ndarray) -> np.ndarray | None:
        """A whole read of a few READY blocks into private memory at ``dst`` (``fused.get_blocks``:
        snapshot, bounds, copy by the plan template ``tmpl``, revalidation, in one kernel call),
        counted and touched as ``validate_read`` does. Returns the snapshot (this node's scratch:
        valid until its next fused call), or None when the step-by-step path must run (some
        block absent, not READY, or with payload bounds that do not fit; nothing copied:
        ``fused_snapshot`` says what it saw). Raises BlockEvicted (the output is not to be
        trusted), as ``validate_read``."""
        if self.pause_after_snapshot is not None:
            return None
        n = len(keys)
        snap, ok = self._fsnap[:n], self._fok[:n]
        bad = int(fused.get_blocks(self.mem, self._fp, self.index.tgeo, words, tmpl,
                                   np.uint64(dst), self.validate_reads, snap, ok))
        if bad < 0:
            return None
        self.count_read(keys, ok, bad, n * self.layout.block_bytes, snap[:, SNAP_SLOT], snap[:, SNAP_VERSION],
                        snap[:, SNAP_POFF])
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

    def validate_read(self, keys: list[bytes], words: np.ndarray, snap: np.ndarray,
                      nbytes: int, *, cpu: bool = True) -> None:
        """Step 4 of a read, after the copy has completed (on a GPU: after its DMA): every
        block must still be the one snapshotted (entry and slot tag, ``PrefixIndex.revalidate``)
        or the whole read is a miss. Counts the read and records LRU touches. ``cpu``: this
        host's CPU copied the bytes (False for a device's DMA): its cached lines are marked
        (``region/cpumarks.py``). Raises BlockEvicted (the output is not to be trusted)."""
        n = len(keys)
        slots, versions = snap[:, SNAP_SLOT], snap[:, SNAP_VERSION]
        ok = np.ones(n, dtype=np.bool_)
        bad = (self.index.revalidate(slots, versions, snap[:, SNAP_POFF], words, ok)
               if self.validate_reads else 0)
        self.count_read(keys, ok, int(bad), nbytes, slots, versions,
                        snap[:, SNAP_POFF] if cpu else None)

    @property
    def cpu_marks(self) -> cpumarks.CpuMarks:
        """This host's record of the payload its CPUs may cache (made on first use)."""
        cm = self._cpu_marks
        if cm is None:
            r = self.region
            cm = self._cpu_marks = cpumarks.CpuMarks(
                cpumarks.sidecar_path(r.path, r.uuid.hex), r.size_bytes)
        return cm

    def count_read(self, keys: list[bytes], ok: np.ndarray, bad: int, nbytes: int,
                   slots: np.ndarray, versions: np.ndarray,
                   cpu_poffs: np.ndarray | None = None) -> None:
        """After a read's revalidation (``bad`` blocks failed, ``ok`` per block): count it,
        and either raise BlockEvicted or record the LRU touches. ``cpu_poffs``: the payload
        offsets this host's CPU read (whole blocks are marked: ``region/cpumarks.py``), also
        when the read failed (its lines are cached all the same); None for a DMA's read."""
        if cpu_poffs is not None and len(cpu_poffs):
            self.cpu_marks.mark(cpu_poffs, 0, self.layout.block_bytes)
        st, n = self.stats, len(keys)
        st.gets += 1
        if bad:
            self._read_rows = []            # the next reads look their keys up again
            st.validation_failures += 1
            st.misses += bad
            first = int(np.flatnonzero(~ok)[0])
            raise BlockEvicted(f"{bad} of {n} blocks were evicted while being read (first: "
                               f"block {first}, {keys[first][:8].hex()}…); the output is not "
                               f"trusted: treat as a miss")
        st.hits += n
        st.blocks_read += n
        st.bytes_got += nbytes
        self.touch(slots, versions)

    def touch(self, slots: np.ndarray, versions: np.ndarray) -> None:
        """Record reads for the approximate LRU, stamped in the region at the next maintenance
        or locked reservation, without the lock (``stores/touches.py``)."""
        self.touches.record(slots, versions)

    async def consume(self, keys: list[bytes], words: np.ndarray, snap: np.ndarray,
                      layer: int | None) -> None:
        """Transfer-only mode, after a validated read: free blocks once their consumer has read
        every layer (``snap`` as validated).

        Freeing takes the global lock. With ``EngineConfig.defer_consume`` the read does not
        wait for it: the blocks go to a background task that frees every pending batch under
        one hold (``_drain_consumed``). Why: on the H100 serving run of 2026-12-06 at 4d2730c
        (``bench/results/gpu-20261206-s38``), every layer of a 512-block prompt reached the
        decode worker 2-4 ms after its publication except the last, 50-83 ms after it: the
        read of the last layer is the one that consumes, and it waited for the lock."""
        if self.cfg.mode != "transfer" or not snap[:, SNAP_FLAGS].any():
            return
        slots, versions, poffs = snap[:, SNAP_SLOT].copy(), snap[:, SNAP_VERSION].copy(), snap[:, SNAP_POFF].copy()
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
        batch = (slots[done], versions[done], poffs[done], np.ascontiguousarray(words[done]))
        if not self.cfg.defer_consume:
            await self._free_consumed([batch])
            return
        self._consume_pending.append(batch)
        t = self._consume_task
        if t is None or t.done():
            self._consume_task = asyncio.get_running_loop().create_task(self._drain_consumed())

    async def _drain_consumed(self) -> None:
        """``defer_consume``: free the pending consumed batches, all of them under one hold of
        the lock, until none is left. A lock that cannot be had (the node revoked or closing)
        leaves them to the transfer deadline (``deferred_consume_failures``)."""
        from ..errors import TractError
        while self._consume_pending:
            batches, self._consume_pending = self._consume_pending, []
            try:
                await self._free_consumed(batches)
            except TractError:
                self.stats.deferred_consume_failures += sum(len(b[0]) for b in batches)

    async def _free_consumed(self, batches: list[tuple[np.ndarray, np.ndarray, np.ndarray,
                                                       np.ndarray]]) -> None:
        slots = np.concatenate([b[0] for b in batches])
        versions = np.concatenate([b[1] for b in batches])
        poffs = np.concatenate([b[2] for b in batches])
        words = np.ascontiguousarray(np.concatenate([b[3] for b in batches]))
        await self.hold_lock(timeout=max(5.0, self.cfg.liveness_timeout_s * 4))
        try:
            check = np.zeros(len(slots), dtype=np.bool_)
            self.index.revalidate(slots, versions, poffs, words, check)
            # only READY entries: a RESERVED one (every layer read before its producer stored
            # READY) is its live producer's to write; its transfer deadline frees it instead
            now = self.index.snapshot(words)
            gone = [int(slots[i]) for i in range(len(slots))
                    if check[i] and now[i, 0] == slots[i] and now[i, 2] == ix.READY]
            self.evictor.slots(gone)
            self.stats.consumed += len(gone)
        finally:
            self.lock.release()

    async def drain_consumed(self) -> None:
        """Wait until the deferred frees queued so far are done (``defer_consume``)."""
        while (t := self._consume_task) is not None and not t.done():
            await asyncio.shield(t)

    # -- maintenance (under the lock) ---------------------------------------------------------
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
        await self.hold_lock(timeout)
        try:
            if dead:
                self.lock.check_token()
                self.alloc.recover_locked(self.lock)
            if asked:
                self._give_chunks_locked()
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
        t = self._consume_task          # deferred frees of consumed blocks go first
        if t is not None and not t.done():
            await asyncio.wait([t], timeout=timeout)
        self.closing = True
        await self.hold_lock(timeout)
        try:
            self.drop_spares()
            self.evictor.slots(
                [x for v in self._in_flight()
                 for x in (v.slots.tolist() if type(v) is FillBatch else (v.slot,))])
            self._reserved.clear()
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
