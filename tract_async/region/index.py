"""The prefix index: an open-addressing table of block entries in the region.

How readers stay lock-free (the LMDB-style essay)
-------------------------------------------------
Every entry (``layout.INDEX_ENTRY``, two lines) is a small seqlock. ``version`` changes whenever
the entry starts to mean something else (reserve, evict) and at no other time. A reader

1. invalidates line 0 and reads state, version, key, payload bounds;
2. checks state (READY, or RESERVED with the wanted layer bit), the full 256-bit key, and that
   the payload lies inside the chunk area and has the size its layout expects;
3. invalidates and copies the payload;
4. invalidates line 0 again and re-reads key, version, state and payload offset (after the copy
   has completed: on a GPU, after the DMA's event). Any change means the block was evicted (and
   maybe reused) during the copy: the result is a miss, never wrong bytes (docs/design.md invariant
   6). The key is compared again because a read of a line is not atomic: the first read can be
   torn against a re-reservation (old key words with the new version) -- the torn-read stress
   test found exactly this when only the version was re-checked;
5. reads the payload slot's tag (``layout.SLOT_TAG``, written by the reservation before any
   payload byte): it must name this entry and version. This catches what the entry alone
   cannot -- an entry left pointing at a slot that was freed and handed to another block (a
   reclaim that missed the index, any index/allocator disagreement): its key and version never
   changed, but the slot's tag did.

Readers therefore pin nothing: an evictor may free a block while a reader copies it, and the
reader's step 4 notices. (What must never be reused under a transfer is memory a *write* may
still land in: a producer's entry is RESERVED, and RESERVED entries are never evicted while the
producer lives; the engine waits for a cancelled put's copy to finish before giving memory up.)

Who writes what, and in what order (lanes: no global lock on the steady-state put)
-------------------------------------------------------------------------------------
The table is cut into *lanes*: entry ``s`` belongs to lane ``s % lanes``, and with a lane per
node id (``lanes_for(max_nodes)``) lane ``n`` is node ``n``'s. A key's probe visits *groups* of
``lanes`` consecutive entries (its home group, then the next, up to ``max_probe`` groups); each
lane's entries along those groups form that lane's own chain, which ends at the lane's first
EMPTY entry. A reader searches every lane (it cannot know who stored the key) and stops when
every lane's chain has ended. The rules that keep one writer per line (docs/design.md invariant 2):

* **The lane's owner, without the lock**, writes an entry of its lane that is EMPTY or a
  TOMBSTONE (to reserve it), its own RESERVED entries (fill, publish, abandon), and the
  tombstones of its lane (sweeping them back to EMPTY).
* **The global-lock holder** writes READY entries of any lane (evict for space, evict on request,
  consume, expire) and, in recovery, the entries of a lane whose node is dead. Its last
  write to an entry of another lane is the tombstone (``evict_batch``: version, then state,
  one line, one flush): from then on the entry is the owner's again, which may reuse it at once.
  It never sweeps another lane's tombstones.

Nobody else writes a RESERVED entry of a live producer or an EMPTY/TOMBSTONE entry of a live
lane, and only lock holders write READY entries: every line has one writer at a time without
mutual exclusion on the put path. What stays under the lock: chunk claims, every eviction of a
READY entry (the owner's own included: another lock holder might be evicting it), and the first
hold of a new incarnation, which empties its lane (``clear_lane``: whatever its
predecessor left) before it writes the lane lock-free. A node judged dead must not go on
writing its lane: its lock-free reservation starts with the allocator's fencing check (its epoch
not reclaimed), the check that guards its lock-free heap writes too. Two nodes may reserve one
key at once, each in its lane; both then hold the same bytes (a key names its content), readers
take the first they find, and each copy is evicted on its own. With one lane for several nodes
(more than ``INDEX_MAX_LANES``), every reservation takes the lock, as before lanes. What a lane
costs: a node's entries fit only in its lane, so the default table has a lane's worth of room
for every node (``engine_layout``), and where a node's window fills, a locked reservation
evicts its oldest READY entry there (``evict_window_batch``).

The steps:

* Reserve (lane owner, once per request batch): in a free or tombstoned entry of its lane in the
  key's window, write line 1 (no layers yet, allocation, producer, LRU clock, flags) with
  non-temporal stores, fence, then line 0 once: ``version + 1``, key, payload bounds and, stored
  last, ``state = RESERVED``; flush. The entry is now the producer's.
* Fill (the producer, no lock): payload bytes of a layer with non-temporal stores and ``sfence``;
  then the layer's bit in line 1 (NT store); the consumer sees the bit only after the bytes. After
  the last layer, a fence, then ``state = READY`` (NT) (docs/design.md invariant 5). The entry is
  handed to the lock holders.
* Evict (lock holder; or the owner, of its own RESERVED entries): ``version + 1``, then
  ``state = TOMBSTONE``, one flush; only then is the payload freed. Tombstones keep probe
  chains intact; reserve reuses them.
* Touch (any reader, no lock): ``last_access_ns`` of READY entries, batched, each a
  non-temporal store of that one word: approximate LRU. The one exception to "one writer per
  line": several readers may stamp one entry at once, and a stamp may race an eviction or a
  reservation. No word but ``last_access_ns`` is written, and no whole line is written back
  (line 1 is otherwise written only with NT word stores, by its producer), so the worst a race
  does is misdate an entry.

Eviction is sampled LRU (as Redis does): to evict k blocks, the ``sample * k`` entries from a
rotating clock hand are looked at and the k least recently touched READY ones are evicted
(``evict_lru_batch``). A node's touches reach the region at its next maintenance or locked
reservation, so recency is approximate by up to one maintenance interval.
Transfer-only entries are never victims before their deadline; after it, they go first.

Lookups and probes are jitted and run one whole batch per call.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from numba import njit

import tract_kernels as K

from ..errors import RegionCorrupt

from . import layout as L

if TYPE_CHECKING:
    from .region import Region

S_IX_READ = K.site("index.entry.invalidate")
S_IX_LINE1_READ = K.site("index.entry.line1.invalidate")
S_IX_REVALIDATE = K.site("index.entry.revalidate.invalidate")
S_IX_PAYLOAD_READ = K.site("index.payload.invalidate")
S_IX_PAYLOAD_WRITE = K.site("index.payload.flush")
S_IX_RESERVE_FLUSH = K.site("index.reserve.flush")
S_IX_EVICT_FLUSH = K.site("index.evict.flush")
S_IX_HDR = K.site("index.header.flush")
S_IX_TAG_READ = K.site("index.slot_tag.invalidate")
S_IX_LANE_READ = K.site("index.lane.invalidate")
S_IX_LANE_FLUSH = K.site("index.lane.flush")

ENTRY_BYTES = L.INDEX_ENTRY.itemsize
"""Every entry offset below is derived from the layout table (``layout.INDEX_ENTRY``), which the
layout signature covers: the jitted code uses these names, never literal offsets."""
_E = {n: L.INDEX_ENTRY.dtype.fields[n][1] for n in L.INDEX_ENTRY.dtype.names}
E_KEY0, E_KEY1, E_KEY2, E_KEY3 = _E["key0"], _E["key1"], _E["key2"], _E["key3"]
E_VERSION, E_STATE = _E["version"], _E["state"]
E_LINE1 = L.LINE_BYTES
"""Line 1 of an entry (layer bits, allocation, LRU clock, ...): invalidated and flushed whole."""
E_POFF, E_PNB = _E["payload_offset"], _E["payload_nbytes"]
E_LLO, E_LHI, E_OWNER, E_TOKEN = _E["layers_lo"], _E["layers_hi"], _E["owner"], _E["alloc_token"]
E_LAST, E_PRODUCER, E_FLAGS, E_DEADLINE = (_E["last_access_ns"], _E["producer"], _E["flags"],
                                           _E["deadline_ns"])
# The columns of a snapshot row (``snapshot_batch``, ``Index.snapshot``: one int64 row per key),
# named here so that no reader indexes them by bare number:
#
# | column | name | what |
# |---|---|---|
# | 0 | SNAP_SLOT | the entry's slot, -1 when the key is absent |
# | 1 | SNAP_VERSION | the entry's version (a revalidation compares it) |
# | 2 | SNAP_STATE | RESERVED / READY / ... |
# | 3 | SNAP_POFF | payload offset in the region |
# | 4 | SNAP_NBYTES | payload bytes |
# | 5, 6 | SNAP_LAYERS (+ word) | the layer bits, 64 layers a word |
# | 7 | SNAP_FLAGS | flags (namespace tag, transfer mode, ...) |
SNAP_SLOT, SNAP_VERSION, SNAP_STATE, SNAP_POFF, SNAP_NBYTES, SNAP_LAYERS, SNAP_FLAGS = 0, 1, 2, 3, 4, 5, 7
SNAP_COLS = 8

_H = {n: L.INDEX_HEADER.dtype.fields[n][1] for n in L.INDEX_HEADER.dtype.names}
H_CLOCK = _H["clock_hand"]
_LN = {n: L.INDEX_LANE.dtype.fields[n][1] for n in L.INDEX_LANE.dtype.names}
LN_PUBLISHES, LN_EVICTIONS, LN_ACTIVE = _LN["publishes"], _LN["evictions"], _LN["active"]
_LANES_FROM_ENTRIES = L.INDEX_LANES_OFFSET - L.PAGE_BYTES
"""Lane 0's counter line relative to the entry array (which starts one page after the header,
checked on attach): the kernels find the lane lines from ``eoff`` alone."""
"""Counter words of a lane's line (``layout.INDEX_LANE``), at ``lane_line(hoff, lane)``."""

EMPTY, RESERVED, READY, TOMBSTONE = L.IX_EMPTY, L.IX_RESERVED, L.IX_READY, L.IX_TOMBSTONE
FLAG_TRANSFER = 1
DEFAULT_MAX_PROBE = 32

TAG_VERSION_BITS = 40
TAG_WORD_BYTES = L.SLOT_TAG.itemsize
TAG_VERSION_MASK = (1 << TAG_VERSION_BITS) - 1
TG_CHUNKS, TG_CHUNK_BYTES, TG_MIN_SLOT, TG_TAGS, TG_TAG_BYTES, TG_END = range(6)
"""Columns of the slot-tag geometry array the kernels take (``tag_geometry``); TG_TAGS < 0
means the region has no slot tags (an index without an allocator: nothing to check)."""


def tag_value(entry_slot: int, version: int) -> int:
    """The slot tag of the reservation (entry ``entry_slot``, ``version``): never 0."""
    return ((entry_slot + 1) << TAG_VERSION_BITS) | (version & TAG_VERSION_MASK)


def section_bytes(capacity: int) -> int:
    """Bytes of the index section for ``capacity`` entries (a power of two)."""
    return L.PAGE_BYTES + capacity * ENTRY_BYTES


def capacity_for(blocks: int) -> int:
    """Entries for about ``blocks`` resident blocks: twice that, a power of two, at least 64."""
    cap = 64
    while cap < 2 * blocks:
        cap *= 2
    return cap


def lanes_for(max_nodes: int) -> int:
    """Lanes of an index for ``max_nodes`` nodes: the power of two at or above it, so every
    node id has a lane of its own (lock-free reservations); 1 beyond ``INDEX_MAX_LANES`` (every
    reservation then takes the global lock)."""
    lanes = 1
    while lanes < max_nodes:
        lanes *= 2
    return lanes if lanes <= L.INDEX_MAX_LANES else 1


def lane_line(header_offset: int, lane: int) -> int:
    """Offset of lane ``lane``'s counter line (``layout.INDEX_LANE``)."""
    return header_offset + L.INDEX_LANES_OFFSET + lane * L.LINE_BYTES


# ---------------------------------------------------------------------------------------------
# jitted primitives (no lock: readers)


@njit(cache=True, nogil=True, forceinline=True)
def _tag_off(tgeo, poff):
    """Offset of the slot tag of the payload at ``poff`` (``layout.SLOT_TAG``), or -1 when the
    region has no tags or ``poff`` lies outside the chunk area."""
    if tgeo[TG_TAGS] < 0 or poff < tgeo[TG_CHUNKS] or poff >= tgeo[TG_END]:
        return np.int64(-1)
    rel = poff - tgeo[TG_CHUNKS]
    chunk = rel // tgeo[TG_CHUNK_BYTES]
    return (tgeo[TG_TAGS] + chunk * tgeo[TG_TAG_BYTES]
            + (rel % tgeo[TG_CHUNK_BYTES]) // tgeo[TG_MIN_SLOT] * TAG_WORD_BYTES)


@njit(cache=True, nogil=True, forceinline=True)
def _tag_of(slot, version):
    return (np.uint64(slot + 1) << np.uint64(TAG_VERSION_BITS)) | (
        np.uint64(version) & np.uint64(TAG_VERSION_MASK))


@njit(cache=True, nogil=True)
def _active(m, eoff, lanes, own=-1):
    """Bit n set when lane n is active (its ``active`` word, fresh): lanes no node ever wrote
    hold only EMPTY entries, so readers skip them. One invalidate per lane and one fence per
    batch, instead of a line per lane per key. A lane that becomes active after this read is
    one whose entries were all reserved after it, so missing them is what a reader that ran a
    moment earlier would have seen; waits read the mask again on every look."""
    if lanes == 1:
        return np.uint64(1)
    base = eoff + _LANES_FROM_ENTRIES
    for n in range(lanes):
        if n != own:     # the caller's own lane: known active, and its line is its own to write
            K.invalidate(m, base + n * L.LINE_BYTES, S_IX_LANE_READ)
    K.full_fence(m)
    act = np.uint64(0) if own < 0 else np.uint64(1) << np.uint64(own)
    for n in range(lanes):
        if n != own and K.load(m, base + n * L.LINE_BYTES + LN_ACTIVE) != 0:
            act |= np.uint64(1) << np.uint64(n)
    return act


@njit(cache=True, nogil=True, forceinline=True)
def _home(k0, mask, lanes):
    """First entry of the key's home group: the group of ``lanes`` entries its hash names."""
    return np.int64(k0 & np.uint64(mask)) & ~np.int64(lanes - 1)


@njit(cache=True, nogil=True)
def _find_from(m, eoff, mask, max_probe, lanes, act, k0, k1, k2, k3, home_fresh):
    """Slot of the live (RESERVED/READY) entry for the key, or -1. Probes group by group (each
    lane's chain is its own: lane n of group p, p = 0, 1, ...); a lane's chain ends at its first
    EMPTY entry, the search when every lane's has (or after ``max_probe`` groups). Invalidates
    each line read, one fence per group, except the home group when ``home_fresh`` (the caller
    invalidated it and fenced). Only the lanes of ``act`` (``_active``) are searched."""
    base = _home(k0, mask, lanes)
    open_ = act
    if open_ == 0:
        return -1
    for p in range(max_probe):
        g = (base + p * lanes) & mask
        if p > 0 or not home_fresh:
            for n in range(lanes):
                if (open_ >> np.uint64(n)) & np.uint64(1):
                    K.invalidate(m, eoff + (g + n) * ENTRY_BYTES, S_IX_READ)
            K.full_fence(m)
        for n in range(lanes):
            if not (open_ >> np.uint64(n)) & np.uint64(1):
                continue
            off = eoff + (g + n) * ENTRY_BYTES
            st = K.load(m, off + E_STATE)
            if st == EMPTY:
                open_ &= ~(np.uint64(1) << np.uint64(n))
                continue
            if st == TOMBSTONE:
                continue
            if (K.load(m, off) == k0 and K.load(m, off + E_KEY1) == k1
                    and K.load(m, off + E_KEY2) == k2 and K.load(m, off + E_KEY3) == k3):
                return g + n
        if open_ == 0:
            return -1
    return -1


@njit(cache=True, nogil=True)
def find_entry(m, eoff, mask, max_probe, lanes, k0, k1, k2, k3):
    """Slot of the live (RESERVED/READY) entry for the key, or -1. Invalidates each line read."""
    return _find_from(m, eoff, mask, max_probe, lanes, _active(m, eoff, lanes), k0, k1, k2, k3,
                      False)


@njit(cache=True, nogil=True)
def _invalidate_homes(m, eoff, mask, lanes, act, keys):
    """Invalidate line 0 of every entry of every key's home group, then one ``mfence``.

    Batching: a clflushopt + mfence pair costs ~300-400 ns because the fence waits for the
    flush; flushing every home line first and fencing once lets the flushes overlap, so a batch
    pays one fence. Each key's first probe then reads
    its home lines from memory; later groups (collisions) invalidate and fence one by one."""
    for i in range(keys.shape[0]):
        base = _home(keys[i, 0], mask, lanes)
        for n in range(lanes):
            if (act >> np.uint64(n)) & np.uint64(1):
                K.invalidate(m, eoff + (base + n) * ENTRY_BYTES, S_IX_READ)
    K.full_fence(m)
    _touch_lines(m, eoff, mask, lanes, act, keys)


@njit(cache=True, nogil=True)
def _touch_lines(m, eoff, mask, lanes, act, keys):
    """Load one word of every home line in a branch-free loop, so that the cache misses overlap
    (the probe loop that follows branches on each line and would take them one at a time)."""
    acc = np.uint64(0)
    for i in range(keys.shape[0]):
        base = _home(keys[i, 0], mask, lanes)
        for n in range(lanes):
            if (act >> np.uint64(n)) & np.uint64(1):
                acc ^= K.load(m, eoff + (base + n) * ENTRY_BYTES + E_STATE)
    return acc


@njit(cache=True, nogil=True)
def lookup_batch(m, eoff, mask, max_probe, lanes, keys):
    """Number of leading keys whose entries are READY (resident and complete)."""
    n = keys.shape[0]
    act = _active(m, eoff, lanes)
    _invalidate_homes(m, eoff, mask, lanes, act, keys)
    for i in range(n):
        slot = _find_from(m, eoff, mask, max_probe, lanes, act, keys[i, 0], keys[i, 1],
                          keys[i, 2], keys[i, 3], True)
        if slot < 0:
            return i
        if K.load(m, eoff + slot * ENTRY_BYTES + E_STATE) != READY:
            return i
    return n


@njit(cache=True, nogil=True)
def snapshot_batch(m, eoff, mask, max_probe, lanes, keys, out):
    """For each key: out[i] = (slot, version, state, payload_offset, nbytes, layers_lo,
    layers_hi, flags); slot = -1 when absent.

    Two passes, one fence each: line 0 of every entry (found from fresh home lines), then line 1
    (layer bits) of every found entry, invalidated only *after* its line 0 was read, so the
    layer bits are never older than the key and version they are paired with (a reserve clears
    line 1 before it writes line 0: older bits could be a previous occupant's)."""
    act = _active(m, eoff, lanes)
    _invalidate_homes(m, eoff, mask, lanes, act, keys)
    for i in range(keys.shape[0]):
        slot = _find_from(m, eoff, mask, max_probe, lanes, act, keys[i, 0], keys[i, 1],
                          keys[i, 2], keys[i, 3], True)
        out[i, SNAP_SLOT] = slot
        if slot < 0:
            continue
        off = eoff + slot * ENTRY_BYTES
        out[i, SNAP_VERSION] = np.int64(K.load(m, off + E_VERSION))
        out[i, SNAP_STATE] = np.int64(K.load(m, off + E_STATE))
        out[i, SNAP_POFF] = np.int64(K.load(m, off + E_POFF))
        out[i, SNAP_NBYTES] = np.int64(K.load(m, off + E_PNB))
    for i in range(keys.shape[0]):
        if out[i, SNAP_SLOT] >= 0:
            K.invalidate(m, eoff + out[i, SNAP_SLOT] * ENTRY_BYTES + E_LINE1, S_IX_LINE1_READ)
    K.full_fence(m)
    for i in range(keys.shape[0]):      # every line in flight at once (mem.prefetch)
        if out[i, SNAP_SLOT] >= 0:
            K.prefetch(m, eoff + out[i, SNAP_SLOT] * ENTRY_BYTES + E_LINE1)
    for i in range(keys.shape[0]):
        if out[i, SNAP_SLOT] < 0:
            continue
        off = eoff + out[i, SNAP_SLOT] * ENTRY_BYTES
        out[i, SNAP_LAYERS] = np.int64(K.load(m, off + E_LLO))
        out[i, SNAP_LAYERS + 1] = np.int64(K.load(m, off + E_LHI))
        out[i, SNAP_FLAGS] = np.int64(K.load(m, off + E_FLAGS))


SNAPSHOT_HOLD_GIL_KEYS = 255
"""Snapshots and revalidations of at most this many keys keep the GIL (``snapshot_batch_held``,
``revalidate_batch_held``): up to ~0.2 µs a key on the 2-core VM, so at most ~50 µs held, where
a release and re-take after another thread waited costs ~7.5 µs there and more on the GPU
hosts (``stores/fused.py``, "Holding the GIL"; on the H100 host a 32- and a 213-block layer read
spent ~40 µs in its prepare and again in its validation with these kernels releasing the GIL
and the CUDA poller waiting for it). Larger snapshots go to ``meta_threads`` threads from
``PARALLEL_META_MIN`` keys on."""


@njit(cache=True)            # holds the GIL (stores/fused.py, "Holding the GIL")
def snapshot_batch_held(m, eoff, mask, max_probe, lanes, keys, out):
    """``snapshot_batch`` without releasing the GIL, for a few keys on the loop's thread."""
    snapshot_batch(m, eoff, mask, max_probe, lanes, keys, out)


@njit(cache=True, nogil=True)
def refresh_layers_batch(m, eoff, out):
    """Re-read line 1 (layer bits, flags) of the entries a snapshot found (``out``: its rows,
    every one present), in place: one invalidation per entry, one fence, then loads whose
    addresses are all known (no hash probe, no home group, no dependent chain).

    Safe with line 0 as snapshotted earlier, for a read that revalidates after its copy: if an
    entry was evicted and its slot reused since, these bits may be the new occupant's, the copy
    then reads the new occupant's bytes, and the revalidation (version, slot tag) rejects them --
    a miss, never wrong bytes."""
    n = out.shape[0]
    for i in range(n):
        K.invalidate(m, eoff + out[i, SNAP_SLOT] * ENTRY_BYTES + E_LINE1, S_IX_LINE1_READ)
    K.full_fence(m)
    for i in range(n):              # every line in flight at once (mem.prefetch)
        K.prefetch(m, eoff + out[i, SNAP_SLOT] * ENTRY_BYTES + E_LINE1)
    for i in range(n):
        off = eoff + out[i, SNAP_SLOT] * ENTRY_BYTES
        out[i, SNAP_LAYERS] = np.int64(K.load(m, off + E_LLO))
        out[i, SNAP_LAYERS + 1] = np.int64(K.load(m, off + E_LHI))
        out[i, SNAP_FLAGS] = np.int64(K.load(m, off + E_FLAGS))


@njit(cache=True)            # holds the GIL (SNAPSHOT_HOLD_GIL_KEYS)
def refresh_layers_batch_held(m, eoff, out):
    """``refresh_layers_batch`` without releasing the GIL."""
    refresh_layers_batch(m, eoff, out)


@njit(cache=True, nogil=True)
def revalidate_batch(m, eoff, tgeo, slots, versions, poffs, keys, ok):
    """After a copy: ok[i] = entry i still holds the same key, version and payload, live, and
    the payload's slot tag still names this entry and version. Returns the number that failed.

    The slot tag closes the class of bugs where the index and the allocator disagree: an entry
    whose slot was freed and handed to another reservation (a reclaim that forgot the index, a
    free without an eviction) keeps its key and version, so the entry checks alone would pass
    and hand out the new occupant's bytes. The new occupant's reservation stored its own tag
    before any of its payload bytes (``reserve_batch``: the tag's NT store precedes the fence
    that precedes RESERVED, and the payload is written after that), and this check reads the
    tag after the copy: if any byte copied came from the new occupant, the tag read here is the
    new one. A carve zeroes a chunk's tags, so a re-carved slot never matches either.

    The key and payload are compared too, not just the version: the first read of a line may be
    torn against a concurrent re-reservation (old key words, new version and payload: a fill or
    a word-by-word read is not atomic), and such a snapshot carries the *new* version. A later,
    fresh read cannot show the old key once memory holds the newer version (the writer stores
    the key words before the version becomes visible with them), so comparing the key catches it.
    """
    bad = 0
    K.full_fence(m)
    for i in range(slots.shape[0]):
        K.invalidate(m, eoff + slots[i] * ENTRY_BYTES, S_IX_REVALIDATE)
        t = _tag_off(tgeo, poffs[i])
        if t >= 0:
            K.invalidate(m, t, S_IX_TAG_READ)
    K.full_fence(m)
    for i in range(slots.shape[0]):     # every line in flight at once (mem.prefetch): on the
        K.prefetch(m, eoff + slots[i] * ENTRY_BYTES)    # 2-core VM 1024 blocks took 96-179 µs
        t = _tag_off(tgeo, poffs[i])                    # without, 71-114 µs with
        if t >= 0:
            K.prefetch(m, t)
    for i in range(slots.shape[0]):
        off = eoff + slots[i] * ENTRY_BYTES
        st = K.load(m, off + E_STATE)
        good = ((st == READY or st == RESERVED)
                and K.load(m, off) == keys[i, 0] and K.load(m, off + E_KEY1) == keys[i, 1]
                and K.load(m, off + E_KEY2) == keys[i, 2] and K.load(m, off + E_KEY3) == keys[i, 3]
                and np.int64(K.load(m, off + E_POFF)) == poffs[i]
                and np.int64(K.load(m, off + E_VERSION)) == versions[i])
        if good and tgeo[TG_TAGS] >= 0:
            t = _tag_off(tgeo, poffs[i])
            good = t >= 0 and K.load(m, t) == _tag_of(slots[i], versions[i])
        ok[i] = good
        if not good:
            bad += 1
    return bad


@njit(cache=True)            # holds the GIL (SNAPSHOT_HOLD_GIL_KEYS)
def revalidate_batch_held(m, eoff, tgeo, slots, versions, poffs, keys, ok):
    """``revalidate_batch`` without releasing the GIL, for a few hundred keys on the loop's
    thread."""
    return revalidate_batch(m, eoff, tgeo, slots, versions, poffs, keys, ok)


@njit(cache=True, nogil=True)
def invalidate_payloads(m, poffs, rel_offset, nbytes):
    """Invalidate [poff + rel_offset, +nbytes) of each block before a device (DMA) reads it.

    A DMA engine is coherent with this host's caches: on non-coherent shared memory a stale
    line cached here would be what the DMA reads, so the reader drops its lines first, exactly
    as a CPU copy does (``read_bytes``)."""
    for i in range(poffs.shape[0]):
        K.invalidate_range(m, poffs[i] + rel_offset, nbytes, S_IX_PAYLOAD_READ)


@njit(cache=True, nogil=True)
def shifted_rows(tmpl, poffs, positions, pos_step):
    """Copy plan rows (region offset, tensor offset, nbytes) of whole blocks, block-major, as
    ``stores/plan.plan`` builds them: the template's rows (one block at payload offset 0 and
    tensor position 0) shifted by each block's payload offset and tensor position
    (``pos_step`` bytes a position). What the one-call transfers build inside their kernel
    (``stores/fused.py``, ``gangcopy.get_checked``)."""
    r = tmpl.shape[0]
    n = poffs.shape[0]
    plan = np.empty((n * r, 3), dtype=np.int64)
    for j in range(n):
        for t in range(r):
            plan[j * r + t, 0] = tmpl[t, 0] + poffs[j]
            plan[j * r + t, 1] = tmpl[t, 1] + positions[j] * pos_step
            plan[j * r + t, 2] = tmpl[t, 2]
    return plan


@njit(cache=True, nogil=True)
def copy_out(m, plan, dst_base):
    """Copy region ranges to private memory: plan rows (region_offset, dst_offset, nbytes)."""
    K.read_rows(m, plan, dst_base, S_IX_PAYLOAD_READ, False)


@njit(cache=True, nogil=True)
def copy_out_nt(m, plan, dst_base):
    """``copy_out`` writing the destination with non-temporal stores (large reads: see
    ``read_rows``)."""
    K.read_rows(m, plan, dst_base, S_IX_PAYLOAD_READ, True)


@njit(cache=True, nogil=True)
def drop_payload_rows_ahead(m, plan, ctl_addr):
    """The invalidating half of a two-thread ``copy_out`` (``K.drop_rows_ahead``)."""
    K.drop_rows_ahead(m, plan, ctl_addr, S_IX_PAYLOAD_READ)


@njit(cache=True, nogil=True)
def copy_out_behind(m, plan, dst_base, ctl_addr, nt_dst):
    """The copying half of a two-thread ``copy_out`` (``K.read_rows_behind``): 1 if the other
    half gave up."""
    return K.read_rows_behind(m, plan, dst_base, ctl_addr, nt_dst)


@njit(cache=True, nogil=True)
def copy_in(m, plan, src_base):
    """Copy private memory into the region: plan rows (region_offset, src_offset, nbytes).
    Non-temporal stores and one ``sfence``: the bytes precede any flag published after it."""
    K.write_rows(m, plan, src_base, S_IX_PAYLOAD_WRITE)


# ---------------------------------------------------------------------------------------------
# producer (owns RESERVED entries, no lock)


@njit(cache=True, nogil=True)
def publish_layers(m, eoff, slots, lo_bits, hi_bits, all_lo, all_hi):
    """OR layer bits into each entry (bytes already in memory); READY once all are present.
    Returns the number of entries that became READY.

    Line 1's layer words have one writer while the entry is RESERVED (its producer: this
    node), so the value stored is the value to test: the second pass decides READY from what
    the first pass computed instead of re-loading line 1. The layer words and the state are
    non-temporal word stores (``reserve_batch`` says why): no flush, an ``sfence`` between the
    layer bits and READY. The load of line 1 reads memory: the reservation's NT stores left
    no cached copy, nor do earlier publishes."""
    n = slots.shape[0]
    done = np.zeros(n, dtype=np.bool_)
    for i in range(n):
        off = eoff + slots[i] * ENTRY_BYTES
        lo = K.load(m, off + E_LLO) | np.uint64(lo_bits)
        hi = K.load(m, off + E_LHI) | np.uint64(hi_bits)
        K.store_nt(m, off + E_LLO, lo)
        K.store_nt(m, off + E_LHI, hi)
        done[i] = lo == np.uint64(all_lo) and hi == np.uint64(all_hi)
    K.store_fence(m)           # every layer bit is in memory before any READY below
    became = 0
    for i in range(n):
        if done[i]:
            K.store_nt(m, eoff + slots[i] * ENTRY_BYTES + E_STATE, READY)
            became += 1
    K.full_fence(m)
    return became


ENTRY_WORDS = ENTRY_BYTES // 8
"""The 8-byte words of an entry: a row of a batch's entry record (``reserve_batch_counted``'s
``lines``, ``publish_layers_lines``), indexed by the entry's byte offsets over 8."""
W_STATE, W_LLO, W_LHI = E_STATE // 8, E_LLO // 8, E_LHI // 8
W_LINE1 = E_LINE1 // 8


@njit(cache=True, nogil=True)
def publish_layers_lines(m, eoff, slots, lines, lo_val, hi_val, all_lo, all_hi):
    """``publish_layers`` for a batch whose entries' words the producer recorded when it
    reserved them (``lines``: one row of ``ENTRY_WORDS`` words an entry, as
    ``reserve_batch_counted`` wrote them): every entry of ``slots`` gets the layer words
    ``lo_val``/``hi_val`` (what it held OR'd with the new layer's bits) with the rest of its
    line 1 as recorded, the whole line as eight non-temporal stores; READY once those are
    every layer's, line 0 likewise written whole from the record with ``state = READY``.
    Returns the number of entries that became READY.

    Why whole lines. Two NT word stores leave a write-combining buffer partly filled, and a
    partial line reaches memory as a partial write (a read-modify-write where memory keeps
    ECC, one at a time per buffer): on the H100 hosts ~94 ns a block, ~20 µs of a 213-block
    layer put's completion (session 53). Eight NT stores fill the buffer, which leaves as one
    full-line write (``bench/line_publish.py``; the 2-core VM: 213 blocks 0.82 against 2.47 µs,
    ``bench/results/vm-20261207-s54``).

    Why it may write words it does not change: line 1 has one writer while the entry is
    RESERVED, its producer, who wrote every word of it at the reservation (the record), and a
    producer's batch (``stores/fillbook.py``, ``FillBatch``) starts with no layer and has
    every layer published through it, so the batch's layer words are what its entries hold.
    The one other store a RESERVED entry can meet is a reader's LRU stamp that raced the
    reservation (module docstring, "Touch"); writing the reservation's clock over it misdates
    nothing that was not misdated already. Line 0 while RESERVED is written by nobody but its
    producer (a lock holder writes it only once it is READY, or when recovery takes back a
    dead node's lane): the record's words are memory's, but for the state. A reader that
    catches the line half written sees the same key, version and payload words either way."""
    n = slots.shape[0]
    lo = np.uint64(lo_val)
    hi = np.uint64(hi_val)
    for i in range(n):
        off = eoff + slots[i] * ENTRY_BYTES
        for w in range(W_LINE1, ENTRY_WORDS):     # in address order: one buffer fills
            if w == W_LLO:
                v = lo
            elif w == W_LHI:
                v = hi
            else:
                v = lines[i, w]
            K.store_nt(m, off + 8 * w, v)
    K.store_fence(m)           # every layer bit is in memory before any READY below
    if lo != np.uint64(all_lo) or hi != np.uint64(all_hi):
        K.full_fence(m)
        return 0
    ready = np.uint64(READY)   # (a bare int beside a uint64 would unify to a float)
    for i in range(n):
        off = eoff + slots[i] * ENTRY_BYTES
        for w in range(W_LINE1):
            K.store_nt(m, off + 8 * w, ready if w == W_STATE else lines[i, w])
    K.full_fence(m)
    return n


# ---------------------------------------------------------------------------------------------
# global-lock holder


@njit(cache=True, nogil=True, forceinline=True)
def _claimed_find(table, slot):
    """Batch position that claimed ``slot`` in this call, or -1 (``table`` rows: slot, position)."""
    h = np.int64((np.uint64(slot) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & (table.shape[0] - 1)
    while table[h, 0] >= 0:
        if table[h, 0] == slot:
            return table[h, 1]
        h = (h + 1) & (table.shape[0] - 1)
    return -1


@njit(cache=True, nogil=True, forceinline=True)
def _claimed_add(table, slot, pos):
    h = np.int64((np.uint64(slot) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & (table.shape[0] - 1)
    while table[h, 0] >= 0:
        h = (h + 1) & (table.shape[0] - 1)
    table[h, 0] = slot
    table[h, 1] = pos


RESERVE_GROUP = 64
LRU_STEP = 64
"""Entries ``evict_lru_batch`` invalidates per fence while it walks from the clock hand."""
"""Keys per store fence in ``reserve_batch``. One ``sfence`` (~0.3 µs) per 64 keys costs ~5 ns
per key, and the group's line-0 copies read by the probe stay in L1 until they are written."""


@njit(cache=True, nogil=True)
def reserve_batch(m, eoff, tgeo, mask, max_probe, lanes, lane, keys, poffs, pnbs, owners,
                  tokens, now_ns, producer, flags, deadline_ns, out):
    """Reserve an entry of lane ``lane`` for each key (the lane owner's step, lock-free when the
    index has a lane per node, else under the global lock; module docstring).

    out[i] = (slot, previous state, new version): slot >= 0 reserved; -1 when the key's probe
    window has no free entry of this lane; -(2 + slot) when the key is already live in any lane
    (or given twice in the batch). Other lanes' entries are only read (for that check).

    Every home line is invalidated first (one fence). Then, per group of ``RESERVE_GROUP`` keys:
    (1) per key: probe (later probes invalidate and fence one by one), then line 1 (no layers,
    allocation, producer, clock, flags) written whole with non-temporal stores (no flush), and
    the payload slot's tag (``layout.SLOT_TAG``: this entry and its new version; NT store: the
    caller owns the slot, so it owns the tag's line);
    (2) ``sfence``: the group's lines 1 and tags are in memory; (3) per key, line 0 written once --
    ``version + 1``, key, payload bounds, and ``state = RESERVED`` as the last store -- and
    flushed; ``mfence`` at the end of the batch. No entry shows RESERVED before all its fields
    are in memory: line 1 by the fence, and inside line 0 the state is stored last, so any
    write-back of that line (an early eviction included) that carries RESERVED carries the
    stores before it (stores reach the line in program order; a line is written back whole). A
    reader that sees the new key with the old state (EMPTY or TOMBSTONE) treats it as absent.

    Why: a store + clflushopt costs ~240 ns per line on this machine kind (the flush waits for
    the dirty line's write-back, and the store first read the line from memory), eight NT word
    stores of a line ~10 ns. Line 0 keeps ordinary stores and one flush: it was just read by
    the probe, and writing its fields NT then the state NT behind a second fence measured no
    faster (0.058 vs 0.053 µs a block). Line 0 used to be written twice (fields, fence, state).

    Slots taken earlier in the batch may still show their old state and key to a later key of
    the same group, so a local table remembers which batch position took each: a later key
    probing one compares its key with that position's (a key given twice is a duplicate) or
    moves on."""
    n = keys.shape[0]
    size = 64
    while size < 2 * n:
        size *= 2
    claimed = np.full((size, 2), -1, dtype=np.int64)
    act = _active(m, eoff, lanes, lane)
    _invalidate_homes(m, eoff, mask, lanes, act, keys)
    for g0 in range(0, n, RESERVE_GROUP):
        g1 = min(n, g0 + RESERVE_GROUP)
        for i in range(g0, g1):
            k0, k1, k2, k3 = keys[i, 0], keys[i, 1], keys[i, 2], keys[i, 3]
            base = _home(k0, mask, lanes)
            free = np.int64(-1)
            prev = np.uint64(EMPTY)
            dup = np.int64(-1)
            open_ = act
            for p in range(max_probe):
                grp = (base + p * lanes) & mask
                if p > 0:
                    for ln in range(lanes):
                        if ((open_ >> np.uint64(ln)) & np.uint64(1)
                                and _claimed_find(claimed, grp + ln) < 0):
                            K.invalidate(m, eoff + (grp + ln) * ENTRY_BYTES, S_IX_READ)
                    K.full_fence(m)
                for ln in range(lanes):
                    if not (open_ >> np.uint64(ln)) & np.uint64(1):
                        continue
                    slot = grp + ln
                    off = eoff + slot * ENTRY_BYTES
                    j = _claimed_find(claimed, slot)
                    if j >= 0:              # its line 0 may not be written yet: compare keys here
                        if (keys[j, 0] == k0 and keys[j, 1] == k1 and keys[j, 2] == k2
                                and keys[j, 3] == k3):
                            dup = slot
                            break
                        continue
                    st = K.load(m, off + E_STATE)
                    if st == EMPTY:
                        open_ &= ~(np.uint64(1) << np.uint64(ln))
                        if ln == lane and free < 0:
                            free = slot
                            prev = st
                        continue
                    if st == TOMBSTONE:
                        if ln == lane and free < 0:
                            free = slot
                            prev = st
                        continue
                    if (K.load(m, off) == k0 and K.load(m, off + E_KEY1) == k1
                            and K.load(m, off + E_KEY2) == k2 and K.load(m, off + E_KEY3) == k3):
                        dup = slot
                        break
                if dup >= 0 or open_ == 0:
                    break
            if dup >= 0:
                out[i, 0] = -(2 + dup)
                out[i, 1] = 0
                out[i, 2] = 0
                continue
            if free < 0:
                out[i, 0] = -1
                out[i, 1] = 0
                out[i, 2] = 0
                continue
            off = eoff + free * ENTRY_BYTES
            # line 1, every word, non-temporal: no read-for-ownership, no flush
            K.store_nt(m, off + E_LLO, 0)
            K.store_nt(m, off + E_LHI, 0)
            K.store_nt(m, off + E_OWNER, owners[i])
            K.store_nt(m, off + E_TOKEN, tokens[i])
            K.store_nt(m, off + E_LAST, now_ns)
            K.store_nt(m, off + E_PRODUCER, producer)
            K.store_nt(m, off + E_FLAGS, flags)
            K.store_nt(m, off + E_DEADLINE, deadline_ns)
            _claimed_add(claimed, free, i)
            out[i, 0] = free
            out[i, 1] = np.int64(prev)
            out[i, 2] = np.int64(K.load(m, off + E_VERSION) + np.uint64(1))
            t = _tag_off(tgeo, np.int64(poffs[i]))
            if t >= 0:
                K.store_nt(m, t, _tag_of(free, out[i, 2]))
        K.store_fence(m)           # the group's lines 1 are in memory before any RESERVED
        for i in range(g0, g1):
            if out[i, 0] >= 0:
                off = eoff + out[i, 0] * ENTRY_BYTES
                K.store(m, off + E_VERSION, np.uint64(out[i, 2]))
                K.store(m, off, keys[i, 0])
                K.store(m, off + E_KEY1, keys[i, 1])
                K.store(m, off + E_KEY2, keys[i, 2])
                K.store(m, off + E_KEY3, keys[i, 3])
                K.store(m, off + E_POFF, poffs[i])
                K.store(m, off + E_PNB, pnbs[i])
                K.store(m, off + E_STATE, RESERVED)      # last (docstring)
                K.flush(m, off, S_IX_RESERVE_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def reserve_batch_counted(m, loff, eoff, tgeo, mask, max_probe, lanes, lane, keys, ainfo, now_ns,
                          producer, flags, deadline_ns, out, lines):
    """``reserve_batch`` with the allocation columns of one (n, 4) uint64 array ``ainfo``
    (payload offset, nbytes, owner word, token), then, when every key was reserved, the
    ``publishes`` counter of the lane's line ``loff`` bumped by n (fresh read, store, flush:
    ``bump_counter``).
    Returns True when it bumped; False leaves the counter to the caller (some key was already
    live or found no free entry: the caller frees those allocations first, as before).

    Why one call: each Python->Numba call that passes the ``Mem`` costs ~1.2 µs of argument
    unboxing, and the counter bump was two more such calls; a small put pays this once. The
    stores, flushes and fences are those of ``reserve_batch`` followed by the bump's, in that
    order, exactly as the separate calls made them.

    ``lines``: (n, ``ENTRY_WORDS``) uint64, or any other number of rows for none: when every key
    was reserved, each row gets the words its entry now holds (``publish_layers_lines`` writes
    a layer's line 1 and the READY line 0 whole from them). Filled here, from the values just
    stored, because a separate call costs the ``Mem``'s unboxing again."""
    reserve_batch(m, eoff, tgeo, mask, max_probe, lanes, lane, keys, ainfo[:, 0], ainfo[:, 1],
                  ainfo[:, 2], ainfo[:, 3], now_ns, producer, flags, deadline_ns, out)
    n = keys.shape[0]
    for i in range(n):
        if out[i, 0] < 0:
            return False
    if lines.shape[0] == n:         # the batch's record of what it wrote (publish_layers_lines)
        for i in range(n):
            lines[i, E_KEY0 // 8] = keys[i, 0]
            lines[i, E_KEY1 // 8] = keys[i, 1]
            lines[i, E_KEY2 // 8] = keys[i, 2]
            lines[i, E_KEY3 // 8] = keys[i, 3]
            lines[i, E_VERSION // 8] = np.uint64(out[i, 2])
            lines[i, W_STATE] = RESERVED
            lines[i, E_POFF // 8] = ainfo[i, 0]
            lines[i, E_PNB // 8] = ainfo[i, 1]
            lines[i, W_LLO] = 0
            lines[i, W_LHI] = 0
            lines[i, E_OWNER // 8] = ainfo[i, 2]
            lines[i, E_TOKEN // 8] = ainfo[i, 3]
            lines[i, E_LAST // 8] = np.uint64(now_ns)
            lines[i, E_PRODUCER // 8] = np.uint64(producer)
            lines[i, E_FLAGS // 8] = np.uint64(flags)
            lines[i, E_DEADLINE // 8] = np.uint64(deadline_ns)
    cur = K.load_fresh(m, loff + LN_PUBLISHES, S_IX_READ)
    K.store_flush(m, loff + LN_PUBLISHES, cur + np.uint64(n), S_IX_HDR)
    return True


@njit(cache=True, nogil=True)
def _sweep_tombstones(m, eoff, mask, lanes, slot):
    """After ``slot`` became a tombstone (the caller owns its lane): if the next entry of its
    lane's chain (``slot + lanes``) is EMPTY, no probe chain runs through ``slot``, so it and
    the tombstones of its lane right before it become EMPTY again (walking back). Without this, constant eviction fills the table with tombstones and every probe
    walks the whole window. Readers racing with it see TOMBSTONE or EMPTY there; either way a
    key that is not live is not found, and no live key lies in a run of tombstones that ends
    in an EMPTY entry. Returns how many entries were emptied."""
    nxt = eoff + ((slot + lanes) & mask) * ENTRY_BYTES
    if K.load_fresh(m, nxt + E_STATE, S_IX_READ) != EMPTY:
        return 0
    n = 0
    t = slot
    while n * lanes <= mask:
        off = eoff + t * ENTRY_BYTES
        if K.load_fresh(m, off + E_STATE, S_IX_READ) != TOMBSTONE:
            break
        K.store(m, off + E_STATE, EMPTY)
        K.flush(m, off, S_IX_EVICT_FLUSH)
        n += 1
        t = (t - lanes) & mask
    K.full_fence(m)
    return n


@njit(cache=True, nogil=True)
def evict_batch(m, eoff, tgeo, mask, lanes, own_lane, slots, new_state, info):
    """Evict entries: per entry, ``version + 1`` and then ``state = new_state`` stored into line
    0 and the line flushed once; one fence for the whole batch. Who may: the lane's owner (any
    entry of its lane), or the global-lock holder (READY entries of any lane, and the entries of
    a lane without a live owner): module docstring, "Who writes what".

    The order inside the line is what lets a lock holder evict in a lane whose owner reserves
    lock-free: the state is the last word stored, so any write-back of the line (an early
    eviction included) that shows TOMBSTONE also carries the new version, and after it the
    evictor never writes the line again -- the owner may take a tombstone for a reservation the
    moment it sees one. A write-back that shows the new version with READY still in place is
    safe for readers: their revalidation compares the version (and the slot tag names the old
    one), and the payload is freed only after the whole batch is in memory.

    The caller frees the payloads afterwards: info[i] = (payload_offset, nbytes, owner, token,
    slot is the entry's), read fresh before the entry changed. The last column is 1 when the
    payload slot's tag names this entry and version (or the region has no tags), else 0: the
    entry was stale (its slot was reused by another reservation) and its payload must *not* be
    freed -- that would free the new occupant's slot under it.
    ``new_state=EMPTY`` only undoes the caller's own reservation of an entry that was EMPTY in
    the same batch (no probe chain can run through it then). Tombstones of ``own_lane`` (-1:
    none) are swept (``_sweep_tombstones``); others' are left to their lane's owner."""
    for i in range(slots.shape[0]):
        off = eoff + slots[i] * ENTRY_BYTES
        K.invalidate(m, off, S_IX_READ)
        K.invalidate(m, off + E_LINE1, S_IX_LINE1_READ)
    K.full_fence(m)
    for i in range(slots.shape[0]):       # the tag lines after the entries' (their payloads)
        t = _tag_off(tgeo, np.int64(K.load(m, eoff + slots[i] * ENTRY_BYTES + E_POFF)))
        if t >= 0:
            K.invalidate(m, t, S_IX_TAG_READ)
    K.full_fence(m)
    for i in range(slots.shape[0]):
        off = eoff + slots[i] * ENTRY_BYTES
        info[i, 0] = np.int64(K.load(m, off + E_POFF))
        info[i, 1] = np.int64(K.load(m, off + E_PNB))
        info[i, 2] = np.int64(K.load(m, off + E_OWNER))
        info[i, 3] = np.int64(K.load(m, off + E_TOKEN))
        info[i, 4] = 1
        version = K.load(m, off + E_VERSION)
        if tgeo[TG_TAGS] >= 0:
            t = _tag_off(tgeo, info[i, 0])
            if t < 0 or K.load(m, t) != _tag_of(slots[i], version):
                info[i, 4] = 0
        K.store(m, off + E_VERSION, version + np.uint64(1))
        K.store(m, off + E_STATE, new_state)          # last: see the docstring
        K.flush(m, off, S_IX_EVICT_FLUSH)
    K.full_fence(m)
    if new_state == TOMBSTONE and own_lane >= 0:
        for i in range(slots.shape[0]):
            if slots[i] & (lanes - 1) == own_lane:
                _sweep_tombstones(m, eoff, mask, lanes, slots[i])


CLEAR_GROUP = 64
"""Entries of a lane that ``clear_lane`` invalidates behind one fence."""


@njit(cache=True, nogil=True)
def clear_lane(m, eoff, mask, lanes, lane):
    """Empty every entry of ``lane`` and mark the lane active (its owner's first step, under the
    global lock, before its first write of the lane: a new incarnation of a node takes over
    what its predecessor left).
    Live entries get ``version + 1`` (a reader mid-copy then misses); every entry ends EMPTY --
    with no live entry left in the lane, no chain of the lane needs a tombstone. Payloads are
    not freed: they lie in the predecessor's chunks, which recovery reclaims whole. Returns how
    many live entries were dropped.

    Cost: a lane never active (a fresh region, or a node id never used) holds only EMPTY
    entries -- nobody writes a lane before its owner's first ``clear_lane`` marked it active, and
    the mark is never taken back -- so its scan is skipped. Otherwise the lane's lines are read
    in groups of ``CLEAR_GROUP``: all invalidated, one fence, then loaded (one fence per entry
    cost ~0.3 µs each: 5-36 ms per engine open on a large index). Nobody else writes the lane
    meanwhile: its old owner is gone, and the caller holds the lock that every other writer of
    its entries (READY evictions) needs."""
    n = 0
    lane_line = eoff + _LANES_FROM_ENTRIES + lane * L.LINE_BYTES
    if K.load_fresh(m, lane_line + LN_ACTIVE, S_IX_LANE_READ) != 0:
        step = lanes * CLEAR_GROUP
        for first in range(lane, mask + 1, step):
            last = min(mask + 1, first + step)
            for slot in range(first, last, lanes):
                K.invalidate(m, eoff + slot * ENTRY_BYTES, S_IX_READ)
            K.full_fence(m)
            for slot in range(first, last, lanes):
                off = eoff + slot * ENTRY_BYTES
                st = K.load(m, off + E_STATE)
                if st == EMPTY:
                    continue
                if st == READY or st == RESERVED:
                    K.store(m, off + E_VERSION, K.load(m, off + E_VERSION) + np.uint64(1))
                    n += 1
                K.store(m, off + E_STATE, EMPTY)
                K.flush(m, off, S_IX_EVICT_FLUSH)
    K.full_fence(m)
    # active before any entry of the lane is reserved (readers skip inactive lanes: _active)
    K.store(m, lane_line + LN_ACTIVE, np.uint64(1))
    K.flush(m, lane_line, S_IX_LANE_FLUSH)
    K.full_fence(m)
    return n


_NOT_A_VICTIM = np.uint64(2**64 - 1)


@njit(cache=True, nogil=True, forceinline=True)
def _victim_age(m, off, now_ns):
    """The LRU sort key of the entry at ``off`` (lines already fresh): 0 for an expired
    transfer-only entry (goes first), else its last touch | 1; ``_NOT_A_VICTIM`` when it is
    not READY or is an unexpired transfer-only entry (never evicted for space)."""
    if K.load(m, off + E_STATE) != READY:
        return _NOT_A_VICTIM
    if K.load(m, off + E_FLAGS) & np.uint64(FLAG_TRANSFER):
        if np.int64(K.load(m, off + E_DEADLINE)) > now_ns:
            return _NOT_A_VICTIM
        return np.uint64(0)
    return K.load(m, off + E_LAST) | np.uint64(1)


@njit(cache=True, nogil=True)
def evict_lru_batch(m, hoff, eoff, tgeo, cap, lanes, own_lane, sample, now_ns, k, prefer_node,
                    only_prefer, info):
    """Evict up to ``k`` victims by sampled LRU over one window: entries from the clock hand
    are read until ``sample * k`` candidates (evictable READY entries) were seen or the whole
    table was, and the ``k`` least recently touched among them go (expired transfer-only
    entries first; unexpired ones are never victims): ``sample`` candidates per victim.
    info[j] = (slot, payload_offset, nbytes, owner, token, slot is the entry's: see
    ``evict_batch``). Blocks in ``prefer_node``'s chunks go before any other node's (-1: no
    preference): evicting another node's block frees a slot of *its* heap, not the
    evictor's; ``only_prefer``: no other node's block is a candidate at all (evicting ahead of
    need frees only the evictor's own slots). Returns how many were evicted."""
    hand = np.int64(K.load_fresh(m, hoff + H_CLOCK, S_IX_READ))
    want = max(sample, sample * k)
    cand_t = np.empty(want + LRU_STEP, dtype=np.uint64)
    cand_s = np.empty(want + LRU_STEP, dtype=np.int64)
    nc = 0
    walked = 0
    # walk from the hand until ``want`` candidates were seen (not ``want`` entries: with a lane
    # per node most of the table can be empty), one fence per step of LRU_STEP entries
    while nc < want and walked < cap:
        step = min(LRU_STEP, cap - walked)
        for s in range(walked, walked + step):
            off = eoff + ((hand + s) % cap) * ENTRY_BYTES
            K.invalidate(m, off, S_IX_READ)
            K.invalidate(m, off + E_LINE1, S_IX_LINE1_READ)
        K.full_fence(m)
        for s in range(walked, walked + step):
            slot = (hand + s) % cap
            off = eoff + slot * ENTRY_BYTES
            t = _victim_age(m, off, now_ns)
            if t == _NOT_A_VICTIM:
                continue
            if prefer_node >= 0 and np.int64(K.load(m, off + E_OWNER) & np.uint64(0xFFFF)) != prefer_node:
                if only_prefer:
                    continue
                t = (t >> np.uint64(2)) | np.uint64(1 << 62)          # after every own block
            cand_t[nc] = t
            cand_s[nc] = slot
            nc += 1
        walked += step
    window = walked
    order = np.argsort(cand_t[:nc])
    n = min(k, nc)
    victims = np.empty(n, dtype=np.int64)
    for j in range(n):
        victims[j] = cand_s[order[j]]
        info[j, 0] = victims[j]
    tmp = np.zeros((n, 5), dtype=np.int64)
    evict_batch(m, eoff, tgeo, cap - 1, lanes, own_lane, victims, TOMBSTONE, tmp)
    for j in range(n):
        for c in range(5):
            info[j, 1 + c] = tmp[j, c]
    K.store(m, hoff + H_CLOCK, np.uint64((hand + window) % cap))
    K.flush(m, hoff + H_CLOCK, S_IX_HDR)
    K.full_fence(m)
    return n


@njit(cache=True, nogil=True)
def evict_window_batch(m, eoff, tgeo, mask, max_probe, lanes, lane, keys, now_ns, info):
    """For each key whose probe window holds no free entry of ``lane``: evict the least
    recently touched READY entry of ``lane`` in that window (unexpired transfer-only entries are
    never victims), global-lock holder only. info[j] = (slot, then ``evict_batch``'s five
    columns). Returns how many were evicted. This is what a lane gives up against one shared
    table: a node that alone fills the region fills its lane's windows first."""
    n = keys.shape[0]
    victims = np.empty(n, dtype=np.int64)
    nv = 0
    for i in range(n):
        base = _home(keys[i, 0], mask, lanes)
        best = np.int64(-1)
        best_t = np.uint64(0)
        for p in range(max_probe):
            slot = ((base + p * lanes) & mask) + lane
            off = eoff + slot * ENTRY_BYTES
            K.invalidate(m, off, S_IX_READ)
            K.invalidate(m, off + E_LINE1, S_IX_LINE1_READ)
            K.full_fence(m)
            t = _victim_age(m, off, now_ns)
            if t == _NOT_A_VICTIM:
                continue
            seen = False
            for j in range(nv):
                seen = seen or victims[j] == slot
            if not seen and (best < 0 or t < best_t):
                best = slot
                best_t = t
        if best >= 0:
            victims[nv] = best
            nv += 1
    tmp = np.zeros((nv, 5), dtype=np.int64)
    evict_batch(m, eoff, tgeo, mask, lanes, lane, victims[:nv], TOMBSTONE, tmp)
    for j in range(nv):
        info[j, 0] = victims[j]
        for c in range(5):
            info[j, 1 + c] = tmp[j, c]
    return nv


@njit(cache=True, nogil=True)
def touch_batch(m, eoff, slots, versions, times_ns):
    """Stamp last_access of READY entries whose version is unchanged with ``times_ns[i]`` (when
    each read happened: a stamp of the flush's time made a block read before another was
    written look the newer of the two). Returns #stamped.

    Any node, no lock: one fence for all line 0 reads, then ``last_access_ns`` alone, a
    non-temporal word store (no read-for-ownership of line 1, no write-back of the whole line,
    so no other word of it is ever overwritten), one ``sfence``. A stamp that lands on an entry
    evicted and re-reserved since its check only misdates that entry for the LRU."""
    for i in range(slots.shape[0]):
        K.invalidate(m, eoff + slots[i] * ENTRY_BYTES, S_IX_READ)
    K.full_fence(m)
    n = 0
    for i in range(slots.shape[0]):
        off = eoff + slots[i] * ENTRY_BYTES
        if (K.load(m, off + E_STATE) == READY
                and np.int64(K.load(m, off + E_VERSION)) == versions[i]):
            K.store_nt(m, off + E_LAST, times_ns[i])
            n += 1
    K.store_fence(m)
    return n


@njit(cache=True, nogil=True)
def scan_entries(m, eoff, cap, out):
    """Fresh (state, payload_offset, nbytes, producer, flags, deadline, owner, token, version)
    of every entry, for recovery, reaping and fsck."""
    for slot in range(cap):
        off = eoff + slot * ENTRY_BYTES
        K.invalidate(m, off, S_IX_READ)
        K.invalidate(m, off + E_LINE1, S_IX_LINE1_READ)
        K.full_fence(m)
        out[slot, 0] = np.int64(K.load(m, off + E_STATE))
        out[slot, 1] = np.int64(K.load(m, off + E_POFF))
        out[slot, 2] = np.int64(K.load(m, off + E_PNB))
        out[slot, 3] = np.int64(K.load(m, off + E_PRODUCER))
        out[slot, 4] = np.int64(K.load(m, off + E_FLAGS))
        out[slot, 5] = np.int64(K.load(m, off + E_DEADLINE))
        out[slot, 6] = np.int64(K.load(m, off + E_OWNER))
        out[slot, 7] = np.int64(K.load(m, off + E_TOKEN))
        out[slot, 8] = np.int64(K.load(m, off + E_VERSION))


EXPIRY_SCAN_GROUP = 128
"""Entries whose two lines are invalidated before one fence in ``expired_transfer_slots``."""


@njit(cache=True, nogil=True)
def expired_transfer_slots(m, eoff, cap, now_ns, out):
    """Slots of READY transfer-only entries whose deadline has passed (``deadline_ns <=
    now_ns``) into ``out`` (int64, >= ``cap``); returns their count. Why not ``scan_entries``:
    that one fences once per entry and fills a (capacity, 9) table, ~20 ms for 65,536 entries
    on the 2-core VM, so a transfer-mode engine's maintenance (every 0.2 s in the serving
    workers) stalled both of their threads ~70 ms at a time on a 32 GiB region. Here the lines
    of ``EXPIRY_SCAN_GROUP`` entries are invalidated before one fence, only three words are
    loaded, and nothing is written but ``out``. The caller holds the global lock, so a READY
    entry it evicts cannot change under it."""
    n = 0
    for base in range(0, cap, EXPIRY_SCAN_GROUP):
        hi = min(cap, base + EXPIRY_SCAN_GROUP)
        for slot in range(base, hi):
            off = eoff + slot * ENTRY_BYTES
            K.invalidate(m, off, S_IX_READ)
            K.invalidate(m, off + E_LINE1, S_IX_LINE1_READ)
        K.full_fence(m)
        for slot in range(base, hi):
            off = eoff + slot * ENTRY_BYTES
            if np.int64(K.load(m, off + E_STATE)) != READY:
                continue
            if (np.int64(K.load(m, off + E_FLAGS)) & FLAG_TRANSFER) == 0:
                continue
            if np.int64(K.load(m, off + E_DEADLINE)) <= now_ns:
                out[n] = slot
                n += 1
    return n


# ---------------------------------------------------------------------------------------------
# the Python face


def tag_geometry(region: "Region") -> np.ndarray:
    """The slot-tag geometry the kernels take (columns ``TG_*``); TG_TAGS = -1 when the region
    has no allocator (and so no tags)."""
    from ..errors import RootNameNotFound
    from .chunks import alloc_geometry
    t = np.full(6, -1, dtype=np.int64)
    try:
        g = alloc_geometry(region)
    except RootNameNotFound:
        return t
    t[TG_CHUNKS], t[TG_CHUNK_BYTES], t[TG_MIN_SLOT] = g.chunks_offset, g.chunk_bytes, g.min_slot_bytes
    t[TG_TAGS], t[TG_TAG_BYTES] = g.tags_offset, g.tag_lines * L.LINE_BYTES
    t[TG_END] = g.chunks_offset + g.nchunks * g.chunk_bytes
    return t


@dataclass(frozen=True, kw_only=True)
class IndexGeometry:
    """Where the index lives: section offset, entry array, capacity, probe window (in groups
    of ``lanes`` entries), lanes."""
    header_offset: int
    entries_offset: int
    capacity: int
    max_probe: int
    lanes: int = 1


PARALLEL_META_MIN = 2048
"""Snapshots of at least this many keys are split over ``meta_threads`` threads. Why: a
snapshot is a chain of hash probes, invalidations and loads per key, and threads overlap their
memory latency -- but handing parts to a pool and collecting them costs ~0.1 ms on the GPU
hosts. Measured on the H100 host (``bench/results/gpu-20261207-s48``, one process, four
threads against one): 1024 keys 116 against 79 µs, 2048 keys 164 against 184, 4096 keys 271
against 436; the threshold was 256 before. Revalidations are not split at all: with their
loads prefetched (``revalidate_batch``) one thread took 65-107 µs for 1024 keys and 286 for
4096, four threads 128-197 and 289; at 1024 keys the split made a layer get's completion
297-314 µs against 106-173 (``gpu_layers --sections layer_ops``, same host, alternating)."""

_META_POOL: Any = None
_META_POOL_LOCK = threading.Lock()


def _in_parts(n: int, threads: int, part: Callable[[int, int], int]) -> list[int]:
    """Run ``part(lo, hi)`` over ``threads`` consecutive ranges of ``[0, n)``: the first on the
    calling thread, the rest on a process-wide pool; returns their results in order (the
    caller waits for all, also when one raised)."""
    global _META_POOL
    if _META_POOL is None:
        with _META_POOL_LOCK:
            if _META_POOL is None:
                from concurrent.futures import ThreadPoolExecutor
                _META_POOL = ThreadPoolExecutor(MAX_META_THREADS - 1,
                                                thread_name_prefix="tract-meta")
    t = max(1, min(threads, MAX_META_THREADS, n))
    bounds = [n * i // t for i in range(t + 1)]
    futs = [_META_POOL.submit(part, bounds[i], bounds[i + 1]) for i in range(1, t)]
    try:
        first = part(bounds[0], bounds[1])
    finally:
        rest = [f.result() for f in futs]       # never return while a part still runs
    return [first, *rest]


MAX_META_THREADS = 4


def auto_meta_threads(cpus: int, backend_hw: bool) -> int:
    """``PrefixIndex.meta_threads`` for a host of ``cpus`` usable CPUs: 4 from 8 CPUs on, else 1
    (on 2 cores the loop's own thread is the better place); 1 on the sim backend.
    ``$TRACT_META_THREADS`` overrides."""
    env = os.environ.get("TRACT_META_THREADS")
    if env:
        return max(1, min(MAX_META_THREADS, int(env)))
    if not backend_hw:
        return 1
    return MAX_META_THREADS if cpus >= 8 else 1


class PrefixIndex:
    """The index of one region, seen by one node (its ``Mem``). No asyncio here: the engine
    takes the global lock around the ``*_locked`` methods."""

    def __init__(self, region: "Region", section_name: str = "index") -> None:
        self.region = region
        sec = region.section(section_name)
        m = region.mem
        where = f"{region.path}: index section at {sec.offset_bytes}"
        if sec.nbytes < section_bytes(1):
            raise RegionCorrupt(f"{where}: {sec.nbytes} bytes, too small for the index header "
                                f"and one entry: the root directory is damaged")
        hdr = np.zeros(L.INDEX_HEADER.itemsize, dtype=np.uint8)
        K.read_bytes(m, sec.offset_bytes, hdr.ctypes.data, hdr.size, S_IX_READ)
        rec = hdr.view(L.INDEX_HEADER.dtype)[0]
        if int(rec["magic"]) != L.INDEX_MAGIC:
            raise RegionCorrupt(f"{where} has magic {int(rec['magic']):#x}, expected "
                                f"{L.INDEX_MAGIC:#x} (region created without an index, or the "
                                f"index header is damaged)")
        cap, eoff, probe = int(rec["capacity"]), int(rec["entries_off"]), int(rec["max_probe"])
        lanes = int(rec["lanes"])
        # the jitted probes trust these words for every address they compute (slot & mask,
        # entries_off + slot * ENTRY_BYTES, max_probe iterations): refuse a header that would
        # send them outside the section instead of reading wild memory
        if cap < 1 or cap & (cap - 1) or sec.nbytes < section_bytes(cap):
            raise RegionCorrupt(f"{where}: capacity {cap} is not a power of two that fits the "
                                f"section's {sec.nbytes} bytes: the index header is damaged")
        if eoff != sec.offset_bytes + L.PAGE_BYTES:
            raise RegionCorrupt(f"{where}: entries at {eoff}, expected "
                                f"{sec.offset_bytes + L.PAGE_BYTES}: the index header is damaged")
        if lanes < 1 or lanes & (lanes - 1) or lanes > min(L.INDEX_MAX_LANES, cap):
            raise RegionCorrupt(f"{where}: {lanes} lanes is not a power of two of at most "
                                f"{min(L.INDEX_MAX_LANES, cap)}: the index header is damaged")
        if not 1 <= probe <= cap // lanes:
            raise RegionCorrupt(f"{where}: probe window {probe} outside 1..{cap // lanes}: the "
                                f"index header is damaged")
        self.geo = IndexGeometry(header_offset=sec.offset_bytes, entries_offset=eoff,
                                 capacity=cap, max_probe=probe, lanes=lanes)
        self.tgeo = tag_geometry(region)
        self.meta_threads = 1
        """Threads a large snapshot or revalidation is split over (``_in_parts``); the owner
        sets it (``BlockLifecycle``: ``auto_meta_threads``). 1 on the sim backend, whose
        private cache model is not thread-safe."""

    @staticmethod
    def format(region: "Region", section_name: str = "index", *,
               max_probe: int = DEFAULT_MAX_PROBE, lanes: int = 1) -> None:
        """Write an empty index into its section (creator only, before anyone attaches), with
        ``lanes`` lanes (``lanes_for``: one per node id makes every node's reservations
        lock-free)."""
        if lanes < 1 or lanes & (lanes - 1) or lanes > L.INDEX_MAX_LANES:
            raise ValueError(f"lanes must be a power of two of at most {L.INDEX_MAX_LANES}, "
                             f"got {lanes}")
        sec = region.section(section_name)
        cap = 64
        while section_bytes(cap * 2) <= sec.nbytes:
            cap *= 2
        if section_bytes(cap) > sec.nbytes:
            raise ValueError(f"index section of {sec.nbytes} bytes is too small")
        m = region.mem
        zeros = np.zeros(section_bytes(cap), dtype=np.uint8)
        K.write_bytes(m, sec.offset_bytes, zeros.ctypes.data, zeros.size, S_IX_HDR)
        hdr = np.zeros(1, dtype=L.INDEX_HEADER.dtype)
        hdr["capacity"] = cap
        hdr["max_probe"] = min(max_probe, cap // lanes)
        hdr["lanes"] = lanes
        hdr["entries_off"] = sec.offset_bytes + L.PAGE_BYTES
        raw = hdr.view(np.uint8)
        K.write_bytes(m, sec.offset_bytes, raw.ctypes.data, raw.size, S_IX_HDR)
        K.store_flush(m, sec.offset_bytes, L.INDEX_MAGIC, S_IX_HDR)

    @property
    def mask(self) -> int:
        return self.geo.capacity - 1

    @property
    def lanes(self) -> int:
        return self.geo.lanes

    def lane_of(self, slot: int) -> int:
        """The lane entry ``slot`` belongs to (its owner node, when there is a lane per node)."""
        return slot & (self.geo.lanes - 1)

    def lockfree_for(self, max_nodes: int) -> bool:
        """Whether every node id below ``max_nodes`` has a lane of its own: then a node reserves
        in its lane without the global lock (module docstring)."""
        return self.geo.lanes >= max_nodes

    def lookup(self, key_words: np.ndarray) -> int:
        """Leading READY keys (lock-free)."""
        g = self.geo
        return int(lookup_batch(self.region.mem, g.entries_offset, self.mask, g.max_probe,
                                g.lanes, key_words))

    def snapshot(self, key_words: np.ndarray) -> np.ndarray:
        """(n, 8) int64: slot, version, state, payload_offset, nbytes, layers_lo, layers_hi, flags.
        Up to ``SNAPSHOT_HOLD_GIL_KEYS`` keys without releasing the GIL (``stores/fused.py``,
        "Holding the GIL"): every wait's re-check takes one."""
        g = self.geo
        n = key_words.shape[0]
        out = np.zeros((n, SNAP_COLS), dtype=np.int64)
        if n >= PARALLEL_META_MIN and self.meta_threads > 1:
            m, mask = self.region.mem, self.mask

            def part(lo: int, hi: int) -> int:
                snapshot_batch(m, g.entries_offset, mask, g.max_probe, g.lanes,
                               key_words[lo:hi], out[lo:hi])
                return 0
            _in_parts(n, self.meta_threads, part)
            return out
        fn = (snapshot_batch_held if n <= SNAPSHOT_HOLD_GIL_KEYS else snapshot_batch)
        fn(self.region.mem, g.entries_offset, self.mask, g.max_probe, g.lanes, key_words, out)
        return out

    def refresh_layers(self, snap: np.ndarray) -> None:
        """Fresh layer bits and flags (columns 5-7) for the entries of an earlier ``snapshot``
        whose rows are all present, in place (``refresh_layers_batch``): what a later layer's
        read of the same blocks needs, for a line per block instead of a lookup."""
        fn = (refresh_layers_batch_held if snap.shape[0] <= SNAPSHOT_HOLD_GIL_KEYS
              else refresh_layers_batch)
        fn(self.region.mem, self.geo.entries_offset, snap)

    def revalidate(self, slots: np.ndarray, versions: np.ndarray, poffs: np.ndarray,
                   key_words: np.ndarray, ok: np.ndarray) -> int:
        """Step 4 of a read (``revalidate_batch``): after the copy, ``ok[i]`` says whether block
        ``i`` is still the one snapshotted (entry and slot tag). Returns how many are not."""
        sl = np.ascontiguousarray(slots, dtype=np.int64)
        vs = np.ascontiguousarray(versions, dtype=np.int64)
        po = np.ascontiguousarray(poffs, dtype=np.int64)
        m, eoff, tgeo = self.region.mem, self.geo.entries_offset, self.tgeo
        n = sl.shape[0]          # (one thread at any size: PARALLEL_META_MIN says why)
        fn = revalidate_batch_held if n <= SNAPSHOT_HOLD_GIL_KEYS else revalidate_batch
        return int(fn(m, eoff, tgeo, sl, vs, po, key_words, ok))

    def drop_spans_locked(self, spans: list[tuple[int, int]]) -> int:
        """Tombstone every live entry whose payload lies in one of ``spans`` ((offset_bytes,
        nbytes) of chunks about to be reclaimed); payloads are not freed (their chunks go back
        whole). The ``on_reclaim`` hook of every reclaim (the engine's recovery and ``fsck
        --repair`` alike): without it, the entries would keep pointing into chunks that other
        nodes then reuse. Returns how many entries were dropped. Caller holds the global lock."""
        if not spans:
            return 0
        table = self.scan()
        live = (table[:, 0] == READY) | (table[:, 0] == RESERVED)
        inside = np.zeros(len(table), dtype=np.bool_)
        for start, nbytes in spans:
            inside |= live & (table[:, 1] >= start) & (table[:, 1] < start + nbytes)
        slots = np.flatnonzero(inside).astype(np.int64)
        if slots.size:
            # no sweep: a lane's tombstones are its owner's to empty (a new incarnation of the
            # dead node may already reserve in that lane, lock-free)
            evict_batch(self.region.mem, self.geo.entries_offset, self.tgeo, self.mask,
                        self.geo.lanes, -1, slots, TOMBSTONE,
                        np.zeros((slots.size, 5), dtype=np.int64))
        return int(slots.size)

    def clear_lane_locked(self, lane: int) -> int:
        """Empty lane ``lane`` (``clear_lane``): its new owner's first step, under the lock."""
        g = self.geo
        return int(clear_lane(self.region.mem, g.entries_offset, self.mask, g.lanes, lane))

    def expired_transfer(self, now_ns: int) -> np.ndarray:
        """Slots of READY transfer-only entries past their deadline (``expired_transfer_slots``);
        the caller holds the global lock."""
        buf = getattr(self, "_expiry_buf", None)
        if buf is None or buf.size < self.geo.capacity:
            buf = self._expiry_buf = np.zeros(self.geo.capacity, dtype=np.int64)
        n = expired_transfer_slots(self.region.mem, self.geo.entries_offset, self.geo.capacity,
                                   np.int64(now_ns), buf)
        return buf[:n].copy()

    def scan(self) -> np.ndarray:
        """(capacity, 9) int64 of every entry (see ``scan_entries``)."""
        out = np.zeros((self.geo.capacity, 9), dtype=np.int64)
        scan_entries(self.region.mem, self.geo.entries_offset, self.geo.capacity, out)
        return out

    def counters(self) -> dict[str, int]:
        """Rack-wide evictions and reservations: the sums over the lanes' counter lines."""
        m = self.region.mem
        out = {"evictions": 0, "publishes": 0}
        for lane in range(self.geo.lanes):
            off = lane_line(self.geo.header_offset, lane)
            out["evictions"] += int(K.load_fresh(m, off + LN_EVICTIONS, S_IX_READ))
            out["publishes"] += int(K.load_fresh(m, off + LN_PUBLISHES, S_IX_READ))
        return out

    def lane_counters_offset(self, lane: int) -> int:
        return lane_line(self.geo.header_offset, lane)

    def bump_counter(self, lane: int, field_offset: int, by: int) -> None:
        """Add ``by`` to a counter (``LN_*``) of ``lane``'s line: only its owner calls this
        (with one lane for all, only under the global lock)."""
        m = self.region.mem
        off = lane_line(self.geo.header_offset, lane) + field_offset
        K.store_flush(m, off, K.load_fresh(m, off, S_IX_READ) + by, S_IX_HDR)
