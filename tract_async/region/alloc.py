"""The two-tier allocator: per-node heaps of KV-block slots over globally claimed chunks.

Tier 1, global (``chunks.py``): fixed-size chunks (default 2 MiB) claimed from a bitmap in the
region under the global lock, each with an owner record. Tier 2, per node (this module): a node
carves each of its chunks into slots of one size class and hands slots out from private free
lists without any lock, so the common allocation costs one flushed store.

Size classes. A chunk serves one slot size, chosen when it is carved: by default the powers of
two from ``min_slot_bytes`` up to ``chunk_bytes`` (a 3 KiB request takes a 4 KiB slot), or the
exact sizes passed as ``size_classes`` (e.g. one per KV layout: a tiny model's few-KiB blocks,
Llama-3-8B's 64 KiB layer blocks or 2 MiB whole blocks). A block is at most one chunk.

Who writes what (layouts in ``layout.py``):
* ``HEAP_META`` and ``HEAP_BITS`` of a chunk: its owner node only. The used-bit of a slot is set
  (stored, flushed) before the slot is returned to the caller, and cleared when it is freed
  back, so the region always records which slots are in use; the free lists are a private
  cache of the clear bits. Nobody else reads these lines except ``fsck`` and recovery.
* Slot tags (``layout.SLOT_TAG``) of a chunk: its owner node only. Zeroed when the chunk is
  carved; the reservation that hands a slot to an index entry stores the entry's identity there
  (``index.reserve_batch``) and every read checks it after its copy, so a disagreement between
  the index and the allocator (an entry left pointing at a slot that was freed and reused) reads
  as a miss, never as another block's bytes.
* Return rings, one per (owner, sender) pair: a slot of node O freed by node S is pushed by S
  onto ring (O, S): entry stored and flushed, then ``head += 1`` stored and flushed (publish
  order: an entry is visible before the head that covers it). O pops in ``drain_returns``:
  invalidate head, read entries, clear the used-bits, then ``tail = head``, flush. The head line
  and the entries have one writer (S), the tail line one writer (O). S never overwrites an entry
  O has not consumed (``head - tail < ring_entries``, tail read fresh); when the ring is full the
  entry waits in S's private pending list and is retried on S's next call.
* Entries carry the chunk generation (low 24 bits): a return for a chunk that was reclaimed and
  claimed again since is recognised and dropped, never applied to the new owner's slot.

Starving. Chunks never move while their owner lives, so a node that finds no free chunk
(a node restarted on a rack whose survivors hold them all) records how many it wants in its
``ALLOC_COUNT.wanted`` under the lock and waits. Owners look at the asks whenever they hold the
lock (a reservation batch at most every few ms, and maintenance when an ask is up): one holding more than its
fair share (chunks / live nodes) evicts the blocks of its least used chunks and releases them
(``release_empty_locked``); the asker claims them on its next try and clears its ask. Eviction
for space takes the evicting node's own blocks first (only those free its own slots).

Death. A dead node's private free lists die with it; recovery (``chunks.reclaim_dead``, run by
whoever takes the global lock next) releases all of its chunks, calls the ``on_reclaim`` hooks so
that the index drops entries into them, and records the reclaimed epoch. An incarnation of a node
that finds its epoch recorded there (it was paused, not dead) gets ``NodeEvicted`` from every
later ``alloc``/``free``: its memory belongs to others now. Slots that a *sender* had freed but
not yet pushed when it died stay marked used in their owner's heap (a leak bounded by the sender's
pending list, visible in ``fsck`` as used slots, recovered when the owner releases the chunk).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np
from numba import njit

import tract_kernels as K

from ..errors import AllocationInvalid, AllocationTooLarge, LockRevoked, NodeEvicted, RegionFull
from . import layout as L
from .chunks import (AllocGeometry, ChunkTable, alloc_geometry, sections_for,  # noqa: F401
                     S_COUNT_READ)
from .nodes import DEFAULT_LIVENESS_TIMEOUT_S

if TYPE_CHECKING:
    from .region import Region

S_HEAP_FLUSH = K.site("alloc.heap.flush")
S_HEAP_READ = K.site("alloc.heap.invalidate")
S_RING_ENTRY_FLUSH = K.site("alloc.ring.entry.flush")
S_RING_ENTRY_READ = K.site("alloc.ring.entry.invalidate")
S_RING_HEAD_FLUSH = K.site("alloc.ring.head.flush")
S_RING_HEAD_READ = K.site("alloc.ring.head.invalidate")
S_RING_TAIL_FLUSH = K.site("alloc.ring.tail.flush")
S_RING_TAIL_READ = K.site("alloc.ring.tail.invalidate")
S_TAG_CLEAR_FLUSH = K.site("alloc.tag.clear.flush")

GEN_MASK = 0xFFFFFF

RECLAIM_SCAN_S = 0.25
"""A chunk claim reads the whole owner table at most this often unless the per-node counts
show a node that is not live holding chunks (``Allocator.recover_locked``)."""
_H = {n: L.HEAP_META.dtype.fields[n][1] for n in ("slot_bytes", "nslots", "generation", "used")}
_H_USED = _H["used"]


def encode_entry(generation: int, chunk: int, slot: int) -> int:
    """A return-ring entry (never 0: generations start at 1)."""
    return ((generation & GEN_MASK) << 40) | (chunk << 16) | slot


def decode_entry(entry: int) -> tuple[int, int, int]:
    """(generation & GEN_MASK, chunk, slot) of a return-ring entry."""
    return entry >> 40, (entry >> 16) & 0xFFFFFF, entry & 0xFFFF


@njit(cache=True)            # holds the GIL (stores/fused.py, "Holding the GIL")
def _ring_push(m, off, head, ring_entries, entry):
    """``entry`` into the return ring at ``off`` (this node its sender), ``head`` its next
    index: the entry, flushed, then (after a store fence) the head that covers it, flushed and
    fenced. False, nothing written, when the ring is full (by a fresh read of its tail).
    One kernel call: seven word-sized calls from Python each let the GIL go (a remote free
    cost 10.5 µs a slot on the 2-core VM that way, 16.6 beside a thread wanting the GIL)."""
    tail = np.int64(K.load_fresh(m, off + 64, S_RING_TAIL_READ))
    if head - tail >= ring_entries:
        return False
    eoff = off + 128 + (head % ring_entries) * 8
    K.store(m, eoff, entry)                       # 1. the entry
    K.flush(m, eoff, S_RING_ENTRY_FLUSH)
    K.store_fence(m)
    K.store(m, off, head + 1)                     # 2. then the head that covers it
    K.flush(m, off, S_RING_HEAD_FLUSH)
    K.full_fence(m)
    return True


@njit(cache=True)            # holds the GIL (stores/fused.py, "Holding the GIL")
def _ring_take(m, off, tail, ring_entries, out):
    """The entries a sender pushed into the ring at ``off`` since ``tail``, read fresh into
    ``out`` (its head first, then each entry); returns how many (at most ``len(out)``)."""
    head = np.int64(K.load_fresh(m, off, S_RING_HEAD_READ))
    n = min(head - tail, out.shape[0])
    for i in range(n):
        out[i] = np.int64(K.load_fresh(m, off + 128 + ((tail + i) % ring_entries) * 8,
                                       S_RING_ENTRY_READ))
    return n


@njit(cache=True)            # holds the GIL (stores/fused.py, "Holding the GIL")
def _ring_release(m, off, tail):
    """Tell the sender of the ring at ``off`` that its entries up to ``tail`` were taken."""
    K.store(m, off + 64, tail)
    K.flush(m, off + 64, S_RING_TAIL_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def _publish_heap_words(m, word_offs, word_vals, used_offs, used_vals):
    """Store bitmap words and used counts of this node's heap records, flush each, one fence."""
    for i in range(word_offs.shape[0]):
        K.store(m, word_offs[i], np.uint64(word_vals[i]))
        K.flush(m, word_offs[i], S_HEAP_FLUSH)
    for i in range(used_offs.shape[0]):
        K.store(m, used_offs[i], np.uint64(used_vals[i]))
        K.flush(m, used_offs[i], S_HEAP_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def _publish_heap_word(m, word_off, word_val, used_off, used_val):
    """``_publish_heap_words`` for one bitmap word and one used count (the 1-slot alloc or free
    of a small put): the same stores, flushes and fence, without building four arrays."""
    K.store(m, word_off, np.uint64(word_val))
    K.flush(m, word_off, S_HEAP_FLUSH)
    K.store(m, used_off, np.uint64(used_val))
    K.flush(m, used_off, S_HEAP_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def _set_bits(used, words, slots, value, touched):
    """Mark ``slots`` of one chunk used (``value``) or free in its private ``used`` flags and
    bitmap ``words``; the touched word indices go to ``touched``, ascending, and their count is
    returned. Returns ``-1 - i`` without changing anything when slot ``slots[i]`` is already
    in that state (an allocator bug, or a double free)."""
    for i in range(slots.shape[0]):
        if used[slots[i]] == value:
            return -1 - i
    nw = words.shape[0]
    mark = np.zeros(nw, dtype=np.bool_)
    for i in range(slots.shape[0]):
        s = slots[i]
        used[s] = value
        w = s >> 6
        bit = np.uint64(1) << np.uint64(s & 63)
        if value:
            words[w] |= bit
        else:
            words[w] &= ~bit
        mark[w] = True
    n = 0
    for w in range(nw):
        if mark[w]:
            touched[n] = w
            n += 1
    return n


@njit(cache=True, nogil=True)
def _take_runs(m, used_all, words_all, runs, slots, out):
    """Hand out the slots of several of this node's chunks in one call: the bulk step of
    ``Allocator.alloc_many_nowait`` (``TAKE_MIN_SLOTS``). ``runs``: one row per chunk,
    columns ``R_*`` (chunk, slots taken, the first of them in ``slots``, used count after,
    heap record offset, slot offset base, slot bytes, generation, token, owner, nbytes).
    Marks each taken slot used in the private flags and bitmap words (rows of ``used_all`` /
    ``words_all``, indexed by chunk), stores and flushes every touched bitmap word and each
    chunk's used count, one fence; fills ``out`` (``allocation_rows``' columns). Returns 0,
    or ``-1 - i`` with nothing changed when ``slots[i]`` is already marked used (a bug)."""
    for r in range(runs.shape[0]):
        ci, k, s0 = runs[r, 0], runs[r, 1], runs[r, 2]
        for j in range(s0, s0 + k):
            if used_all[ci, slots[j]]:
                return -1 - j
    for r in range(runs.shape[0]):
        ci, k, s0 = runs[r, 0], runs[r, 1], runs[r, 2]
        heap = runs[r, 4]
        lo_w, hi_w = words_all.shape[1], -1
        for j in range(s0, s0 + k):
            s = slots[j]
            used_all[ci, s] = True
            w = s >> 6
            words_all[ci, w] |= np.uint64(1) << np.uint64(s & 63)
            lo_w = min(lo_w, w)
            hi_w = max(hi_w, w)
            out[j, 0] = runs[r, 5] + s * runs[r, 6]       # A_OFFSET
            out[j, 1] = runs[r, 10]                       # A_NBYTES
            out[j, 2] = runs[r, 6]                        # A_SLOT_BYTES
            out[j, 3] = runs[r, 9]                        # A_OWNER
            out[j, 4] = ci                                # A_CHUNK
            out[j, 5] = s                                 # A_SLOT
            out[j, 6] = runs[r, 7]                        # A_GEN
            out[j, 7] = runs[r, 8]                        # A_TOKEN
        for w in range(lo_w, hi_w + 1):   # the words between the lowest and highest touched
            off = heap + 64 + w * 8
            K.store(m, off, words_all[ci, w])
            K.flush(m, off, S_HEAP_FLUSH)
        K.store(m, heap + _H_USED, np.uint64(runs[r, 3]))
        K.flush(m, heap + _H_USED, S_HEAP_FLUSH)
    K.full_fence(m)
    return 0


(R_CHUNK, R_COUNT, R_FIRST, R_NUSED, R_HEAP, R_BASE, R_SLOT_BYTES, R_GEN, R_TOKEN, R_OWNER,
 R_NBYTES) = range(11)
"""Columns of ``_take_runs``' ``runs``."""

TAKE_MIN_SLOTS = 2 * 8
"""``alloc_many_nowait`` takes batches of at least this many slots as ``allocation_rows``
through ``_take_runs`` (one kernel call for all their chunks); smaller ones per chunk. A
16 MiB put of 64 KiB blocks takes its 256 slots from 8 chunks: ~17 µs of numpy per chunk on
the 2-core VM (slicing, bit setting, eight column stores, a publication), 140 µs in all, about a
third of the put's reservation."""


@njit(cache=True, nogil=True)
def _clear_tags(m, tag_offs):
    """Zero the slot tags of freed slots (owner-only words), flush each, one fence."""
    for i in range(tag_offs.shape[0]):
        K.store(m, tag_offs[i], np.uint64(0))
        K.flush(m, tag_offs[i], S_TAG_CLEAR_FLUSH)
    K.full_fence(m)


SMALL_BATCH = 8
"""Batches of at most this many slots update the private bitmap with Python ints: a numpy
round (fancy indexing, ``bitwise_or.at``, ``unique``) costs ~1-3 µs per operation, more than
the whole loop for a few slots."""


class Allocation(NamedTuple):
    """One allocated slot: the allocator's boundary type. Pass it back to ``free``.

    A NamedTuple rather than a frozen dataclass: a put of a 256 MiB request creates 4096 of them
    under the global lock, and a frozen dataclass costs ~2 µs each to build (~0.3 µs here)."""
    offset_bytes: int      # from the region base
    nbytes: int            # as requested
    slot_bytes: int        # capacity of the slot
    owner_node: int        # node whose heap the slot belongs to
    chunk_index: int
    slot_index: int
    generation: int        # chunk generation it was carved under
    token: int             # fencing token of the chunk's claim


(A_OFFSET, A_NBYTES, A_SLOT_BYTES, A_OWNER, A_CHUNK, A_SLOT, A_GEN,
 A_TOKEN) = (Allocation._fields.index(f) for f in (
    "offset_bytes", "nbytes", "slot_bytes", "owner_node", "chunk_index", "slot_index",
    "generation", "token"))
"""Columns of ``allocation_rows``."""


def allocation_rows(allocations: Sequence[Allocation]) -> np.ndarray:
    """A batch of allocations as one int64 array, a row each, columns ``A_*``: ``np.fromiter``
    over the chained tuples (0.5 ms for 4096 of them; ``np.array`` 1.2 ms, a tuple per row 2 ms)."""
    nf = len(Allocation._fields)
    return np.fromiter(chain.from_iterable(allocations), dtype=np.int64,
                       count=len(allocations) * nf).reshape(-1, nf)


def allocations_of_rows(*rows: np.ndarray) -> list[Allocation]:
    """``allocation_rows`` (one array or several) back to Allocation objects, in order."""
    return [Allocation._make(r) for part in rows for r in part.tolist()]


@dataclass(kw_only=True)
class _Chunk:
    index: int
    generation: int
    token: int
    slot_bytes: int
    nslots: int
    used: np.ndarray                      # bool[nslots]
    free: list[int] = field(default_factory=list)
    words: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    """The heap bitmap words as the region holds them (``used`` packed, 64 slots a word)."""
    run_fields: tuple[int, ...] | None = field(default=None, repr=False)
    """``_take_runs``' fixed fields of this chunk (heap offset, chunk offset, slot bytes,
    generation, token, owner), built at its first large take: they never change for this
    object (a chunk claimed again is a new ``_Chunk``)."""

    def set_used(self, slots: np.ndarray | list[int], value: bool) -> np.ndarray | list[int]:
        """Mark ``slots`` used (or free) in ``used`` and ``words``; the word indices touched,
        ascending (a sorted list for a small batch, else an array)."""
        if len(slots) <= SMALL_BATCH:
            used, words = self.used, self.words
            touched: list[int] = []
            for s in slots:
                s = int(s)
                used[s] = value
                w = s >> 6
                cur = int(words[w])
                words[w] = (cur | (1 << (s & 63))) if value else (cur & ~(1 << (s & 63)))
                if w not in touched:
                    touched.append(w)
            touched.sort()
            return touched
        touched = np.empty(len(slots), dtype=np.int64)
        n = _set_bits(self.used, self.words, np.asarray(slots, dtype=np.int64), value, touched)
        if n < 0:
            raise AssertionError(f"allocator: chunk {self.index} slot {int(slots[-1 - n])} is "
                                 f"already {'used' if value else 'free'}")
        return touched[:n]

    @property
    def nused(self) -> int:
        return self.nslots - len(self.free)


@dataclass(frozen=True, kw_only=True)
class AllocStatistics:
    chunks: int
    slots_used: int
    bytes_used: int
    by_class: dict[int, tuple[int, int]]      # slot_bytes -> (chunks, used slots)
    returns_sent: int
    returns_received: int
    returns_dropped: int
    returns_pending: int
    chunk_claims: int
    chunk_releases: int
    reclaimed: int


class Allocator:
    """The allocator of ``region`` for node ``node_handle``: see the module docstring.

    ``size_classes``: exact slot sizes to serve (multiples of 64 bytes, at most ``chunk_bytes``);
    default powers of two from the region's ``min_slot_bytes``. ``keep_free_chunks``: empty
    chunks per class kept when trimming. ``on_reclaim(node_id, [(offset_bytes, nbytes), ...])``
    runs under the global lock before a dead node's chunks are released. ``fault_hook(point)``
    is for crash tests.
    """

    def __init__(self, region: "Region", node_handle: Any, *,
                 size_classes: Sequence[int] | None = None, keep_free_chunks: int = 1,
                 liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
                 on_reclaim: Callable[[int, list[tuple[int, int]]], None] | None = None,
                 fault_hook: Callable[[str], None] | None = None) -> None:
        self._region = region
        self.geo: AllocGeometry = alloc_geometry(region)
        self.table = ChunkTable(region, fault_hook=fault_hook)
        self.node_id = int(node_handle.node_id)
        self.epoch = int(node_handle.epoch)
        self.liveness_timeout_s = liveness_timeout_s
        self.keep_free_chunks = keep_free_chunks
        self.on_reclaim = on_reclaim
        g = self.geo
        if size_classes is None:
            classes, s = [], g.min_slot_bytes
            while s <= g.chunk_bytes:
                classes.append(s)
                s *= 2
        else:
            classes = sorted(set(int(c) for c in size_classes))
            for c in classes:
                if c <= 0 or c % 64 or c < g.min_slot_bytes or c > g.chunk_bytes \
                        or g.chunk_bytes // c > 65535 \
                        or g.chunk_bytes // c > g.heap_bitmap_lines * 512:
                    raise ValueError(f"size class {c}: must be a multiple of 64 bytes, at least "
                                     f"the region's min_slot_bytes={g.min_slot_bytes} (one "
                                     f"slot tag per min_slot_bytes), at most "
                                     f"chunk_bytes={g.chunk_bytes}, and give at most "
                                     f"{g.heap_bitmap_lines * 512} slots per chunk")
        self.size_classes: tuple[int, ...] = tuple(classes)
        most = g.chunk_bytes // classes[0]
        self._used_all = np.zeros((g.nchunks, most), dtype=np.bool_)
        self._words_all = np.zeros((g.nchunks, (most + 63) // 64), dtype=np.uint64)
        """Every chunk's private used flags and bitmap words, a row per chunk index (a
        ``_Chunk``'s ``used`` and ``words`` are views of its row), so that one kernel call can
        take slots from many chunks (``_take_runs``). Rows of chunks this node never owns are
        never written (zero-filled pages the OS maps on first write only)."""
        self._chunks: dict[int, _Chunk] = {}
        self._free: dict[int, list[int]] = {c: [] for c in classes}   # class -> chunk indices
        self._ring_head = np.zeros(g.max_nodes, dtype=np.int64)         # rings (o, me)
        self._ring_tail = np.zeros(g.max_nodes, dtype=np.int64)         # rings (me, s)
        self._ring_buf = np.empty(g.ring_entries, dtype=np.int64)       # drain_returns's
        m = region.mem
        for other in range(g.max_nodes):
            off_out = g.ring_off(other, self.node_id)
            self._ring_head[other] = int(K.load_fresh(m, off_out, S_RING_HEAD_READ))
            off_in = g.ring_off(self.node_id, other)
            self._ring_tail[other] = int(K.load_fresh(m, off_in + 64, S_RING_TAIL_READ))
        self._pending: dict[int, list[int]] = {}
        self._sent = self._received = self._dropped = 0
        self._claims = self._releases = self._reclaimed = 0
        self._next_scan = 0.0            # monotonic time of the next full owner scan
        self._orphans: list[tuple[int, int]] = []
        """(chunk, generation) of claims that completed while this node's token was being
        revoked (``chunks.claim_many``): never carved, given back at the next hold"""

    # -- helpers ----------------------------------------------------------------------------
    def class_for(self, nbytes: int) -> int:
        """The slot size serving ``nbytes``. Raises AllocationTooLarge, ValueError."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        for c in self.size_classes:
            if c >= nbytes:
                return c
        raise AllocationTooLarge(f"{nbytes} bytes exceed the largest slot "
                                 f"({self.size_classes[-1]} bytes, chunk_bytes="
                                 f"{self.geo.chunk_bytes}); create the region with larger chunks "
                                 f"(EngineConfig.chunk_bytes)")

    def check_not_fenced(self) -> None:
        """Raise NodeEvicted when this incarnation's chunks were reclaimed (it was judged dead,
        perhaps only paused). One fresh load. Allocations and frees call it, and so does a put
        right before its payload copy (``stores/region.py``, "Fenced copies"): a node paused
        between its reservation and its copy must not copy into chunks that were reclaimed,
        and perhaps claimed by another node, meanwhile."""
        ep = int(K.load_fresh_held(self._region.mem, self.geo.count_off(self.node_id) + 8,
                                   S_COUNT_READ))
        if ep >= self.epoch:
            raise NodeEvicted(f"node {self.node_id} (epoch {self.epoch}) was judged dead and its "
                              f"chunks were reclaimed: rejoin before allocating again")

    def _publish(self, touched: dict[int, np.ndarray | list[int]]) -> None:
        """Publish the touched bitmap words and the used count of each touched chunk (owner-only
        lines), one kernel call and one fence for the whole batch."""
        if not touched:
            return
        if len(touched) == 1:
            ((ci, words),) = touched.items()
            if len(words) == 1:             # one slot of a small put: scalars, no arrays
                c = self._chunks[ci]
                w = int(words[0])
                heap = self.geo.heap_off(ci)
                _publish_heap_word(self._region.mem, heap + L.LINE_BYTES + w * 8,
                                   c.words[w], heap + _H["used"], c.nused)  # np.uint64: > 2**63
                return
        offs, vals, uoffs, uvals = [], [], [], []
        for ci, words in touched.items():
            c = self._chunks[ci]
            words = np.asarray(words, dtype=np.int64)
            base = self.geo.heap_off(ci) + L.LINE_BYTES
            offs.append(base + words * 8)
            vals.append(c.words[words])
            uoffs.append(self.geo.heap_off(ci) + _H["used"])
            uvals.append(c.nused)
        _publish_heap_words(self._region.mem, np.concatenate(offs).astype(np.int64),
                            np.concatenate(vals).astype(np.uint64),
                            np.array(uoffs, dtype=np.int64), np.array(uvals, dtype=np.uint64))

    # -- allocation -------------------------------------------------------------------------
    def alloc_nowait(self, nbytes: int) -> Allocation | None:
        """A slot from this node's free lists, or None when a new chunk is needed.

        Never blocks, takes no lock. Raises AllocationTooLarge, NodeEvicted.
        """
        got = self.alloc_many_nowait(nbytes, 1)
        return got[0] if got else None

    def alloc_many_nowait(self, nbytes: int, count: int, *, rows: bool = False
                          ) -> list[Allocation] | np.ndarray:
        """Up to ``count`` slots from this node's free lists (fewer when a chunk is needed).

        One fencing check, the slots of each chunk taken as one numpy batch, each touched heap
        word and used count published once, one fence. Never blocks, takes no lock. ``rows``:
        as ``allocation_rows``, built per chunk with numpy (a lock-free reservation of 2048
        pre-claimed slots then builds no Allocation objects). Raises AllocationTooLarge,
        NodeEvicted.
        """
        cls = self.class_for(nbytes)
        self.check_not_fenced()
        if len(self._free[cls]) == 0:
            self.drain_returns()
        if rows and count >= TAKE_MIN_SLOTS:
            return self._take_rows(cls, nbytes, count)
        out: list[Allocation] = []
        parts: list[np.ndarray] = []
        have = 0
        touched: dict[int, np.ndarray] = {}
        node = self.node_id
        while have < count and self._free[cls]:
            c = self._chunks[self._free[cls][-1]]
            if not c.free:
                raise AssertionError(f"allocator: chunk {c.index} is on the free list of class "
                                     f"{cls} with no free slot")
            k = min(count - have, len(c.free))
            taken = c.free[-k:][::-1]              # pop order: lowest free slot first
            del c.free[-k:]
            have += k
            if k <= SMALL_BATCH and any(c.used[s] for s in taken):
                raise AssertionError(f"allocator: chunk {c.index} hands out a slot marked used")
            touched[c.index] = c.set_used(taken, True)   # (a large batch checks in there)
            base = self.geo.chunk_off(c.index)
            sb, ci, gen, tok = c.slot_bytes, c.index, c.generation, c.token
            if rows:
                t = np.asarray(taken, dtype=np.int64)
                r = np.empty((k, len(Allocation._fields)), dtype=np.int64)
                r[:, A_OFFSET] = base + t * sb
                r[:, A_NBYTES] = nbytes
                r[:, A_SLOT_BYTES] = sb
                r[:, A_OWNER] = node
                r[:, A_CHUNK] = ci
                r[:, A_SLOT] = t
                r[:, A_GEN] = gen
                r[:, A_TOKEN] = tok
                parts.append(r)
            elif k <= SMALL_BATCH:
                out.extend([Allocation(base + s * sb, nbytes, sb, node, ci, s, gen, tok)
                            for s in taken])
            else:   # ~0.25 us a slot instead of ~0.6 (tuple.__new__ from C, no argument parsing)
                out.extend(map(Allocation._make,
                               zip([base + s * sb for s in taken], repeat(nbytes), repeat(sb),
                                   repeat(node), repeat(ci), taken, repeat(gen), repeat(tok))))
            if not c.free:
                self._free[cls].pop()
        self._publish(touched)
        if rows:
            if not parts:
                return allocation_rows([])
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out

    def _take_rows(self, cls: int, nbytes: int, count: int) -> np.ndarray:
        """``alloc_many_nowait(..., rows=True)`` of a large batch: the free lists give up their
        slots here (per chunk, a slice), one ``_take_runs`` call does the rest for every chunk
        (the region's bitmap words and used counts, one fence, the rows)."""
        free_list = self._free[cls]
        chunks = self._chunks
        runs: list[tuple[int, ...]] = []
        flat: list[int] = []
        have = 0
        tail = (nbytes,)
        # (per chunk: a slice of its free list, reversed -- pop order: lowest free slot first --
        # and one tuple of the run's fields; the fixed ones cached on the chunk. A whole
        # prompt's 27 chunks cost ~8-10 µs less so on the 2-core VM, in-process A/B,
        # bench/results/vm-20261208-s55)
        while have < count and free_list:
            c = chunks[free_list[-1]]
            cf = c.free
            nf = len(cf)
            if nf == 0:
                raise AssertionError(f"allocator: chunk {c.index} is on the free list of class "
                                     f"{cls} with no free slot")
            k = count - have
            if k >= nf:
                k = nf
                taken = cf[::-1]
                cf.clear()
                free_list.pop()
            else:
                taken = cf[nf - 1:nf - k - 1:-1]
                del cf[nf - k:]
            fixed = c.run_fields
            if fixed is None:
                g = self.geo
                fixed = c.run_fields = (g.heap_off(c.index), g.chunk_off(c.index), c.slot_bytes,
                                        c.generation, c.token, self.node_id)
            runs.append((c.index, k, have, c.nslots - nf + k) + fixed + tail)
            flat += taken
            have += k
        out = np.empty((have, len(Allocation._fields)), dtype=np.int64)
        if not have:
            return out
        slots = np.array(flat, dtype=np.int64)
        st = int(_take_runs(self._region.mem, self._used_all, self._words_all,
                            np.array(runs, dtype=np.int64), slots, out))
        if st < 0:           # nothing changed in the region: give the free lists theirs back
            for ci, k, first, *_ in reversed(runs):
                c = chunks[ci]
                if not c.free:
                    free_list.append(ci)
                c.free += flat[first + k - 1:first - 1 if first else None:-1]
            raise AssertionError(f"allocator: a free list holds slot {int(slots[-1 - st])}, "
                                 f"which is marked used")
        return out

    def alloc_many_locked(self, nbytes: int, count: int, lock: Any, *,
                          partial: bool = False, rows: bool = False
                          ) -> list[Allocation] | np.ndarray:
        """``count`` slots for a caller holding ``lock``: free lists first, then new chunks
        (claimed and carved under the lock, recovery run once). When no chunk is left: with
        ``partial`` the slots obtained so far are returned, else RegionFull is raised with them
        given back. ``rows``: as ``allocation_rows`` (a put of many blocks then builds no
        Allocation objects for its new chunks' slots). Also raises AllocationTooLarge,
        NodeEvicted, LockRevoked."""
        out = self.alloc_many_nowait(nbytes, count, rows=rows)
        carved: list[np.ndarray] = []
        have = len(out)
        recovered = False
        try:
            while have < count:
                cls = self.class_for(nbytes)
                if not recovered:
                    self.recover_locked(lock, scan=False)
                    recovered = True
                per_chunk = self.geo.chunk_bytes // cls
                want = -(-(count - have) // per_chunk)
                got = self._claim(lock, want)
                if not got and self.recover_locked(lock):    # none free: a full scan first
                    got = self._claim(lock, want)
                if not got and self._trim_locked(lock, keep=0):
                    got = self._claim(lock, want)
                if not got:
                    if partial:
                        break
                    most = self.geo.nchunks * per_chunk
                    raise RegionFull(f"no free chunk of {self.geo.chunk_bytes} bytes left in "
                                     f"{self._region.path} ({self.geo.nchunks} chunks) for "
                                     f"{count - have} more {nbytes}-byte blocks" +
                                     (f" (the whole region holds at most {most} of them)"
                                      if count > most else ""))
                self._claims += len(got)
                # the slots of a batch run up through the claimed chunks in address order, so
                # a large put's blocks form one contiguous run (one DMA on the GPU path instead
                # of one per chunk)
                carved.append(self._carve_run(got, cls, lock.token, nbytes, count - have))
                have += len(carved[-1])
        except BaseException:
            for a in ((allocations_of_rows(out) if rows else out)   # type: ignore[operator]
                      + allocations_of_rows(*carved)):
                self.free(a)
            raise
        if rows:
            parts = ([out] if len(out) else []) + carved
            return np.concatenate(parts) if parts else allocation_rows([])
        return out + allocations_of_rows(*carved)   # type: ignore[operator]

    def free_slots(self, nbytes: int) -> int:
        """Slots of ``nbytes``' size class on this node's free lists (returns not yet drained
        not counted): what puts can take without the global lock."""
        chunks = self._chunks
        return sum(len(chunks[ci].free) for ci in self._free[self.class_for(nbytes)])

    def preclaim_locked(self, nbytes: int, slots: int, lock: Any, *, max_chunks: int) -> int:
        """Claim and carve chunks for at least ``slots`` more free slots of ``nbytes``' class
        (at most ``max_chunks`` chunks), leaving every slot on the free lists: the slots that
        later puts take without the lock (``stores/preclaim.py``).
        Returns the chunks claimed; 0 when none is free. Caller holds ``lock``."""
        cls = self.class_for(nbytes)
        want = min(-(-slots // (self.geo.chunk_bytes // cls)), max_chunks)
        if want <= 0:
            return 0
        self.check_not_fenced()
        self.recover_locked(lock, scan=False)
        done = 0
        while done < want:
            got = self._claim(lock, want - done)
            if not got:
                break
            self._claims += len(got)
            self._carve_run(got, cls, lock.token, nbytes, 0)
            done += len(got)
        return done

    async def alloc(self, nbytes: int, lock: Any, *, timeout: float | None = None) -> Allocation:
        """A slot; claims a chunk under ``lock`` (the global lock, index 0) when needed.

        Raises RegionFull (no free chunk, even after returning this node's empty chunks),
        AllocationTooLarge, LockTimeout, LockRevoked, NodeEvicted.
        """
        a = self.alloc_nowait(nbytes)
        if a is not None:
            return a
        await lock.acquire(timeout=timeout)
        try:
            return self.alloc_locked(nbytes, lock)
        finally:
            lock.release()

    def alloc_locked(self, nbytes: int, lock: Any) -> Allocation:
        """``alloc`` for a caller that already holds ``lock``. Raises as ``alloc``."""
        a = self.alloc_nowait(nbytes)
        if a is not None:
            return a
        cls = self.class_for(nbytes)
        self.recover_locked(lock, scan=False)
        got = self._claim_one(lock)
        if got is None and self.recover_locked(lock):
            got = self._claim_one(lock)
        if got is None and self._trim_locked(lock, keep=0):
            got = self._claim_one(lock)
        if got is None:
            raise RegionFull(f"no free chunk of {self.geo.chunk_bytes} bytes left in "
                             f"{self._region.path} ({self.geo.nchunks} chunks) for a "
                             f"{nbytes}-byte block")
        self._claims += 1
        self._carve(got[0], got[1], cls, lock.token)
        a = self.alloc_nowait(nbytes)
        assert a is not None, "allocator: a freshly carved chunk has no free slot"
        return a

    def _carve(self, chunk: int, generation: int, slot_bytes: int, token: int) -> None:
        self._carve_run([(chunk, generation)], slot_bytes, token, 0, 0)

    def _carve_run(self, got: list[tuple[int, int]], slot_bytes: int, token: int, nbytes: int,
                   take: int) -> np.ndarray:
        """Carve the chunks ``got`` (a claimed run: consecutive chunks, ascending, with their
        generations) into ``slot_bytes`` slots and take the first ``take`` slots of the run, in
        address order, as ``nbytes`` allocations (``allocation_rows``: at most ``take``, fewer
        when the run holds fewer slots).

        The run's heap records lie side by side, and so do its slot tags: one non-temporal
        write of every record (meta line and bitmap, with the taken slots already marked used),
        one of the zeroed tags, one fence. A 256 MiB put of 64 KiB blocks carves 128 chunks:
        two kernel calls instead of 256 plus 128 bitmap publications. The tags are zeroed
        because a tag left from the chunk's previous carving (another owner's, maybe another
        slot size) could otherwise still name an old index entry for a word that is now inside
        one of this carving's slots."""
        g, m = self.geo, self._region.mem
        first, count = got[0][0], len(got)
        for i, (chunk, _) in enumerate(got):
            if chunk != first + i:
                raise AssertionError(f"allocator: chunks {[c for c, _ in got]} are not one run")
            if chunk in self._chunks:
                raise AssertionError(f"allocator: chunk {chunk} claimed while this node already "
                                     f"owns it (the chunk bitmap was written without the global "
                                     f"lock?)")
        nslots = g.chunk_bytes // slot_bytes
        nwords = (nslots + 63) // 64
        # slots taken from each chunk: whole chunks first, the rest from the last one
        ks = np.clip(take - np.arange(count, dtype=np.int64) * nslots, 0, nslots)
        used = np.arange(nslots)[None, :] < ks[:, None]               # bool[count, nslots]
        words = np.zeros((count, nwords * 8), dtype=np.uint8)
        words[:, :(nslots + 7) // 8] = np.packbits(used, axis=1, bitorder="little")
        words = words.view(np.uint64)                                 # [count, nwords]
        rec = np.zeros((count, (1 + g.heap_bitmap_lines) * L.LINE_BYTES // 8), dtype=np.uint64)
        rec[:, _H["slot_bytes"] // 8] = slot_bytes
        rec[:, _H["nslots"] // 8] = nslots
        rec[:, _H["generation"] // 8] = [gen for _, gen in got]
        rec[:, _H["used"] // 8] = ks
        w0 = L.LINE_BYTES // 8                                        # the bitmap's first word
        rec[:, w0:w0 + nwords] = words
        K.write_bytes(m, g.heap_off(first), rec.ctypes.data, rec.nbytes, S_HEAP_FLUSH)
        tags = np.zeros(count * g.tag_lines * L.LINE_BYTES, dtype=np.uint8)
        K.write_bytes(m, g.tags_off(first), tags.ctypes.data, tags.size, S_HEAP_FLUSH)
        K.full_fence(m)
        free_list = self._free[slot_bytes]
        ua, wa = self._used_all, self._words_all
        ua[first:first + count] = False
        ua[first:first + count, :nslots] = used
        wa[first:first + count] = 0
        wa[first:first + count, :nwords] = words
        for i, (chunk, gen) in enumerate(got):
            k = int(ks[i])
            self._chunks[chunk] = _Chunk(index=chunk, generation=gen, token=token,
                                         slot_bytes=slot_bytes, nslots=nslots,
                                         used=ua[chunk, :nslots],
                                         free=list(range(nslots - 1, k - 1, -1)),
                                         words=wa[chunk, :nwords])
            if k < nslots:
                free_list.append(chunk)
        n = int(ks.sum())
        out = np.empty((n, len(Allocation._fields)), dtype=np.int64)
        cis = np.repeat(np.arange(first, first + count, dtype=np.int64), ks)
        slots = np.arange(n, dtype=np.int64) - np.repeat(np.arange(count) * nslots, ks)
        out[:, A_OFFSET] = g.chunk_off(0) + cis * g.chunk_bytes + slots * slot_bytes
        out[:, A_NBYTES] = nbytes
        out[:, A_SLOT_BYTES] = slot_bytes
        out[:, A_OWNER] = self.node_id
        out[:, A_CHUNK] = cis
        out[:, A_SLOT] = slots
        out[:, A_GEN] = np.repeat(np.array([gen for _, gen in got], dtype=np.int64), ks)
        out[:, A_TOKEN] = token
        return out

    # -- free -------------------------------------------------------------------------------
    def free(self, allocation: Allocation) -> bool:
        """Give a slot back: to this node's free list, or home through the owner's return ring.

        Returns False when the slot's chunk was reclaimed since (its owner died), or is not a
        chunk of this incarnation (an earlier one of this node id made it): nothing to do.
        Raises AllocationInvalid (double free, not an allocation of this region), NodeEvicted.
        """
        return self.free_many([allocation])[0]

    def free_many(self, allocations: Sequence[Allocation]) -> list[bool]:
        """``free`` for many slots: one fencing check, one publication of the touched heap
        words. Validates every allocation before changing anything (AllocationInvalid, also for
        a slot given twice in the batch)."""
        g = self.geo
        if len(allocations) > SMALL_BATCH:
            fast = self._free_many_local(allocations)
            if fast is not None:
                return fast
        for a in allocations:
            if not (0 <= a.chunk_index < g.nchunks and 0 <= a.owner_node < g.max_nodes
                    and a.offset_bytes == g.chunk_off(a.chunk_index) + a.slot_index * a.slot_bytes):
                raise AllocationInvalid(f"{a!r} is not an allocation of {self._region.path}")
        if not allocations:
            return []
        self.check_not_fenced()
        result = [True] * len(allocations)
        local: dict[int, list[int]] = {}
        for j, a in enumerate(allocations):
            if a.owner_node == self.node_id:
                c = self._chunks.get(a.chunk_index)
                if c is None or (c.generation & GEN_MASK) != (a.generation & GEN_MASK):
                    # not a chunk of this incarnation: an earlier incarnation of this node id
                    # (killed, restarted before recovery reclaimed its chunks) made it, or the
                    # chunk was released or reclaimed since. Its slots are not ours to free;
                    # the chunk goes back whole (reclaim). Like a reclaimed remote chunk.
                    self._dropped += 1
                    result[j] = False
                    continue
                if not 0 <= a.slot_index < c.nslots or not c.used[a.slot_index]:
                    raise AllocationInvalid(
                        f"free of chunk {a.chunk_index} slot {a.slot_index} (generation "
                        f"{a.generation}) on node {self.node_id}: not allocated (double free or "
                        f"stale allocation)")
                local.setdefault(a.chunk_index, []).append(a.slot_index)
        for ci, slots in local.items():
            if len(set(slots)) != len(slots):
                raise AllocationInvalid(f"free of chunk {ci}: a slot is given twice in one batch")
        touched = {ci: self._release_slots(ci, slots) for ci, slots in local.items()}
        self._publish(touched)
        for j, a in enumerate(allocations):
            if a.owner_node == self.node_id:
                continue
            self._flush_pending()
            if self.table.generation(a.chunk_index) != a.generation:
                self._dropped += 1
                result[j] = False
                continue
            entry = encode_entry(a.generation, a.chunk_index, a.slot_index)
            if self._pending.get(a.owner_node) or not self._push(a.owner_node, entry):
                self._pending.setdefault(a.owner_node, []).append(entry)
        return result

    def free_rows(self, rows: np.ndarray) -> list[bool]:
        """``free_many`` of ``allocation_rows``: a large batch of this node's own slots is freed
        from the arrays, without an Allocation object per slot (a full cache's eviction of a
        128 MiB put frees 2048 at a time); anything else takes ``free_many``."""
        if len(rows) > SMALL_BATCH:
            fast = self._free_many_local(rows)
            if fast is not None:
                return fast
        return self.free_many(allocations_of_rows(rows))

    def _free_many_local(self, allocations: Sequence[Allocation] | np.ndarray
                         ) -> list[bool] | None:
        """``free_many`` of a large batch whose every slot is in a chunk this incarnation owns
        (evicting one's own blocks, abandoning a put): the same checks, on arrays, ~3x faster
        than the per-allocation loop. None (nothing changed) when a slot is remote or of a
        chunk not ours: the general path then handles the batch, and raises where it must.
        ``allocations``: a sequence, or already ``allocation_rows``."""
        g = self.geo
        a = allocations if isinstance(allocations, np.ndarray) else allocation_rows(allocations)
        ci, si, sb = a[:, A_CHUNK], a[:, A_SLOT], a[:, A_SLOT_BYTES]
        if not ((ci >= 0).all() and (ci < g.nchunks).all()
                and (a[:, A_OWNER] == self.node_id).all()
                and (a[:, A_OFFSET] == g.chunks_offset + ci * g.chunk_bytes + si * sb).all()):
            return None
        order = np.argsort(ci, kind="stable")
        ci_s = ci[order]
        cuts = np.flatnonzero(np.diff(ci_s)) + 1
        groups = np.split(order, cuts)
        plan = []
        for grp in groups:
            c = self._chunks.get(int(ci[grp[0]]))
            gens = a[grp, A_GEN] & GEN_MASK
            if c is None or (gens != (c.generation & GEN_MASK)).any():
                return None
            slots = si[grp]
            if (slots < 0).any() or (slots >= c.nslots).any():
                return None
            if not c.used[slots].all():
                raise AllocationInvalid(
                    f"free of chunk {c.index}: slot(s) {slots[~c.used[slots]][:4].tolist()} not "
                    f"allocated on node {self.node_id} (double free or stale allocation)")
            if np.unique(slots).shape[0] != slots.shape[0]:
                raise AllocationInvalid(f"free of chunk {c.index}: a slot is given twice in one "
                                        f"batch")
            plan.append((c.index, slots.tolist()))
        self.check_not_fenced()
        self._publish({chunk: self._release_slots(chunk, slots) for chunk, slots in plan})
        return [True] * len(allocations)

    def _release_slots(self, chunk: int, slots: list[int]) -> np.ndarray:
        """Clear used slots of one of this node's chunks; touched word indices.

        The freed slots' tags are zeroed first: an index entry still naming a freed slot (a
        disagreement the tags exist to make harmless) then reads as a miss and, when evicted,
        is dropped without freeing the slot a second time."""
        c = self._chunks[chunk]
        g = self.geo
        if g.tags_offset >= 0:
            base = g.tags_off(chunk)
            step = c.slot_bytes // g.min_slot_bytes * 8
            if len(slots) == 1:
                K.store_flush(self._region.mem, base + slots[0] * step, 0, S_TAG_CLEAR_FLUSH)
            else:
                _clear_tags(self._region.mem, base + np.asarray(slots, dtype=np.int64) * step)
        if not c.free:
            self._free[c.slot_bytes].append(chunk)
        c.free.extend(slots)
        return c.set_used(slots, False)

    def _allocated_here(self, chunk: int, slot: int, generation: int) -> bool:
        """``slot`` of ``chunk`` (of that generation) is an allocated slot of this incarnation."""
        c = self._chunks.get(chunk)
        return (c is not None and (c.generation & GEN_MASK) == (generation & GEN_MASK)
                and 0 <= slot < c.nslots and bool(c.used[slot]))

    def _free_local(self, chunk: int, slot: int, generation: int, *, strict: bool) -> bool:
        if not self._allocated_here(chunk, slot, generation):
            if strict:
                raise AllocationInvalid(f"free of chunk {chunk} slot {slot} (generation "
                                        f"{generation}) on node {self.node_id}: not allocated "
                                        f"(double free or stale allocation)")
            return False
        self._publish({chunk: self._release_slots(chunk, [slot])})
        return True

    def _push(self, owner: int, entry: int) -> bool:
        off = self.geo.ring_off(owner, self.node_id)
        head = int(self._ring_head[owner])
        if not _ring_push(self._region.mem, off, head, self.geo.ring_entries, entry):
            return False
        self._ring_head[owner] = head + 1
        self._sent += 1
        return True

    def _flush_pending(self) -> None:
        for owner, entries in list(self._pending.items()):
            while entries:
                gen, chunk, _slot = decode_entry(entries[0])
                if (self.table.generation(chunk) & GEN_MASK) != gen:
                    entries.pop(0)        # the owner's chunk was reclaimed meanwhile
                    self._dropped += 1
                    continue
                if not self._push(owner, entries[0]):
                    break
                entries.pop(0)
            if not entries:
                del self._pending[owner]

    def drain_returns(self) -> int:
        """Take back the slots other nodes freed (every return ring into this node): per sender,
        its new entries in one kernel call, the valid ones (``_allocated_here``; an entry
        repeated within the batch counts once) freed as one batch, then its tail."""
        g, m = self.geo, self._region.mem
        buf = self._ring_buf
        got = 0
        for sender in range(g.max_nodes):
            if sender == self.node_id:
                continue
            off = g.ring_off(self.node_id, sender)
            tail = int(self._ring_tail[sender])
            n = int(_ring_take(m, off, tail, g.ring_entries, buf))
            if n == 0:
                continue
            local: dict[int, list[int]] = {}
            seen: set[tuple[int, int]] = set()
            for entry in buf[:n].tolist():
                gen, chunk, slot = decode_entry(entry)
                if not self._allocated_here(chunk, slot, gen) or (chunk, slot) in seen:
                    self._dropped += 1
                    continue
                seen.add((chunk, slot))
                local.setdefault(chunk, []).append(slot)
                got += 1
            if local:
                self._publish({ci: self._release_slots(ci, slots) for ci, slots in local.items()})
            tail += n
            _ring_release(m, off, tail)
            self._ring_tail[sender] = tail
        self._received += got
        if self._pending:
            self._flush_pending()
        return got

    # -- chunk housekeeping (under the global lock) -------------------------------------------
    def _claim(self, lock: Any, want: int) -> list[tuple[int, int]]:
        """``table.claim_many`` for this node under ``lock``; a claim that completed but whose
        token was revoked meanwhile is remembered (``_orphans``) before LockRevoked goes on."""
        try:
            return self.table.claim_many(self.node_id, self.epoch, lock.token, lock.check_token,
                                         want)
        except LockRevoked as e:
            self._orphans.extend(e.orphaned)
            raise

    def _claim_one(self, lock: Any) -> tuple[int, int] | None:
        got = self._claim(lock, 1)
        return got[0] if got else None

    def _release_orphans_locked(self, lock: Any) -> int:
        """Give back the chunks of claims that a revocation cut off (``_orphans``), each only
        while the owner record still names this incarnation and that claim's generation (a
        reclaim, had this node been judged dead, released them already). Caller holds
        ``lock``; returns the chunks released. A revocation during this keeps the rest."""
        released = 0
        while self._orphans:
            chunk, gen = self._orphans[-1]
            o = self.table.owner(chunk)
            if (o.owner == self.node_id and o.owner_epoch == self.epoch
                    and o.generation == gen and chunk not in self._chunks):
                self.table.release(chunk, self.node_id, self.epoch, lock.token, lock.check_token)
                self._releases += 1
                released += 1
            self._orphans.pop()
        return released

    def recover_locked(self, lock: Any, *, scan: bool = True) -> list[str]:
        """Finish a pending journal and reclaim dead nodes' chunks; what was done.

        ``scan=False`` (a chunk claim on a put's path) reads the owner table -- every chunk's
        record, ~120-170 µs per claim on the H200 host for a 9 GiB region, and growing with
        the region -- only when it may find something: some node that is not live holds chunks
        by the per-node counts (``max_nodes`` words), or ``RECLAIM_SCAN_S`` passed since the
        last full scan (the owner words the counts cannot show: a damaged word, or chunks of an
        earlier incarnation of a node id that is live again). Reclaiming is for capacity only:
        a claim takes a free chunk either way, and a claim that finds none scans at once
        (``alloc_many_locked``)."""
        done = []
        j = self.table.recover_journal(lock.check_token)
        if j:
            done.append(j)
        if self._orphans:
            n = self._release_orphans_locked(lock)
            if n:
                done.append(f"released {n} chunks of a claim cut off by a revocation")
        nodes = self._region.nodes.all(timeout_s=self.liveness_timeout_s)
        now = time.monotonic()
        if not scan and now < self._next_scan and not self._dead_hold_chunks(nodes):
            return done
        self._next_scan = now + RECLAIM_SCAN_S
        rec = self.table.reclaim_dead(nodes, lock.token, lock.check_token, self.on_reclaim)
        for node, n in rec.items():
            self._reclaimed += n
            done.append(f"reclaimed {n} chunks of dead node {node}")
        return done

    def dead_hold_chunks(self) -> bool:
        """Lock-free look (the node table and the per-node counts): some node that is not live
        holds chunks, which ``recover_locked`` would reclaim. Maintenance asks this, so that a
        dead node's memory comes back although no live node claims a chunk (pre-claimed chunks
        make claims rare)."""
        return self._dead_hold_chunks(self._region.nodes.all(timeout_s=self.liveness_timeout_s))

    def _dead_hold_chunks(self, nodes: list[Any]) -> bool:
        """Some node that is not live (``NodeInfo.dead``) holds chunks by its count word."""
        counts = self.table.counts()["chunks"]
        return any(int(counts[n.node_id]) > 0 and n.dead for n in nodes
                   if n.node_id < counts.shape[0])

    async def recover(self, lock: Any, *, timeout: float | None = None) -> list[str]:
        """Take the lock and run recovery (``recover_locked``)."""
        await lock.acquire(timeout=timeout)
        try:
            return self.recover_locked(lock)
        finally:
            lock.release()

    def _trim_locked(self, lock: Any, *, keep: int) -> int:
        released = self._release_orphans_locked(lock) if self._orphans else 0
        for cls in self.size_classes:
            empty = [ci for ci in self._free[cls] if self._chunks[ci].nused == 0]
            for ci in empty[keep:]:
                self._release_chunk_locked(ci, lock)
                released += 1
        return released

    def _release_chunk_locked(self, chunk: int, lock: Any) -> None:
        """Give one empty chunk of this node back to the global pool (caller holds ``lock``)."""
        c = self._chunks[chunk]
        if c.nused:
            raise AssertionError(f"allocator: release of chunk {chunk} with {c.nused} slots in use")
        self._free[c.slot_bytes].remove(chunk)
        del self._chunks[chunk]
        K.store_flush(self._region.mem, self.geo.heap_off(chunk) + _H["slot_bytes"], 0,
                      S_HEAP_FLUSH)
        self.table.release(chunk, self.node_id, self.epoch, lock.token, lock.check_token)
        self._releases += 1

    def release_empty_locked(self, chunks: Sequence[int], lock: Any) -> list[int]:
        """Release those of ``chunks`` (this node's) that have no slot in use, after taking back
        the slots others returned; the chunks released. Caller holds ``lock`` (index 0)."""
        self.drain_returns()
        done = []
        for ci in chunks:
            c = self._chunks.get(ci)
            if c is not None and c.nused == 0:
                self._release_chunk_locked(ci, lock)
                done.append(ci)
        return done

    def chunk_use(self) -> dict[int, int]:
        """{chunk: slots in use} of every chunk this node owns."""
        return {ci: c.nused for ci, c in self._chunks.items()}

    async def trim(self, lock: Any, *, keep: int | None = None,
                   timeout: float | None = None) -> int:
        """Return empty chunks beyond ``keep`` per class (default ``keep_free_chunks``)."""
        await lock.acquire(timeout=timeout)
        try:
            return self._trim_locked(lock, keep=self.keep_free_chunks if keep is None else keep)
        finally:
            lock.release()

    async def close(self, lock: Any, *, timeout: float | None = None) -> int:
        """Deliver pending returns, take back returned slots, release every empty chunk.

        Chunks with slots still in use stay owned (recovery reclaims them when the node dies).
        Returns the number of chunks released. (Returns that still do not fit their owners'
        rings are lost here: a caller with an event loop retries them first,
        ``pending_returns`` / ``deliver_pending``.)
        """
        self.drain_returns()
        return await self.trim(lock, keep=0, timeout=timeout)

    def pending_returns(self) -> int:
        """Slots this node freed in other nodes' chunks whose returns did not fit the owners'
        rings yet (retried at this node's next allocator call, or by ``deliver_pending``)."""
        return sum(len(v) for v in self._pending.values())

    def deliver_pending(self) -> int:
        """Push pending returns whose owners' rings have room now; how many are still pending."""
        self._flush_pending()
        return self.pending_returns()

    # -- introspection ------------------------------------------------------------------------
    def owned_chunks(self) -> list[int]:
        return sorted(self._chunks)

    def holds_class(self, nbytes: int) -> bool:
        """True when this node owns a chunk carved for ``nbytes``-byte slots: only then can
        evicting blocks give it room (a freed slot of another node's chunk returns to that
        node)."""
        cls = self.class_for(nbytes)
        return any(c.slot_bytes == cls for c in self._chunks.values())

    def self_check(self) -> list[str]:
        """Compare this node's private heap state with the region; the problems found."""
        g, m = self.geo, self._region.mem
        problems = []
        owners = self.table.owners()
        for ci, c in self._chunks.items():
            rec = owners[ci]
            if int(rec["owner"]) != self.node_id + 1 or int(rec["generation"]) != c.generation:
                problems.append(f"chunk {ci}: owner record {int(rec['owner']) - 1} gen "
                                f"{int(rec['generation'])}, private gen {c.generation}")
            raw = np.zeros((1 + g.heap_bitmap_lines) * 64, dtype=np.uint8)
            K.read_bytes(m, g.heap_off(ci), raw.ctypes.data, raw.size, S_HEAP_READ)
            bits = np.unpackbits(raw[64:], bitorder="little")[:c.nslots].astype(bool)
            if not np.array_equal(bits, c.used):
                problems.append(f"chunk {ci}: region bitmap differs from the private one")
            if set(c.free) & set(np.flatnonzero(c.used).tolist()):
                problems.append(f"chunk {ci}: a slot is both free and in use")
            if len(set(c.free)) != len(c.free):
                problems.append(f"chunk {ci}: a slot is twice on the free list")
        return problems

    def statistics(self) -> AllocStatistics:
        by: dict[int, tuple[int, int]] = {}
        for c in self._chunks.values():
            n, u = by.get(c.slot_bytes, (0, 0))
            by[c.slot_bytes] = (n + 1, u + c.nused)
        return AllocStatistics(
            chunks=len(self._chunks), slots_used=sum(u for _, u in by.values()),
            bytes_used=sum(s * u for s, (_, u) in by.items()), by_class=by,
            returns_sent=self._sent, returns_received=self._received,
            returns_dropped=self._dropped,
            returns_pending=sum(len(v) for v in self._pending.values()),
            chunk_claims=self._claims, chunk_releases=self._releases, reclaimed=self._reclaimed)


def heap_record(region: "Region", geo: AllocGeometry, chunk: int) -> tuple[dict[str, int],
                                                                            np.ndarray]:
    """(meta fields, bool used-bits) of one chunk's heap, fresh from memory (fsck, usage)."""
    raw = np.zeros((1 + geo.heap_bitmap_lines) * 64, dtype=np.uint8)
    K.read_bytes(region.mem, geo.heap_off(chunk), raw.ctypes.data, raw.size, S_HEAP_READ)
    meta = raw[:64].view(L.HEAP_META.dtype)[0]
    bits = np.unpackbits(raw[64:], bitorder="little").astype(bool)
    return {n: int(meta[n]) for n in _H}, bits


def ring_state(region: "Region", geo: AllocGeometry, owner: int, sender: int
               ) -> tuple[int, int, list[int]]:
    """(head, tail, pending entries) of ring (owner, sender), fresh from memory."""
    m = region.mem
    off = geo.ring_off(owner, sender)
    head = int(K.load_fresh(m, off, S_RING_HEAD_READ))
    tail = int(K.load_fresh(m, off + 64, S_RING_TAIL_READ))
    entries = []
    if 0 <= head - tail <= geo.ring_entries:
        for k in range(tail, head):
            entries.append(int(K.load_fresh(m, off + 128 + (k % geo.ring_entries) * 8,
                                            S_RING_ENTRY_READ)))
    return head, tail, entries


__all__ = ["Allocation", "AllocStatistics", "Allocator", "AllocGeometry", "alloc_geometry",
           "decode_entry", "encode_entry", "heap_record", "ring_state", "sections_for"]
