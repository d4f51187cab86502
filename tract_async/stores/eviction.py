"""Eviction: tombstone index entries and free their payload slots, in batches.

The block lifecycle (``stores/blocks.py``) decides *when* blocks go: a reservation that finds
the region full, a put that finds its probe window full, an abandoned or consumed reservation,
chunks given to a starving node, a node closing. This module is the one place that does it,
for every one of those: a batch kernel of ``region/index.py`` tombstones the entries (or sets
another state) and reports each entry's payload, and the payload slots go back to the
allocator (``region/alloc.py``) as rows built with numpy, never one ``Allocation`` per block.

What the caller must hold. The global lock, except for entries of this node's own lane that
are not READY (its own reservations: nobody else writes those, ``index.py``). A stale entry,
whose slot already names another reservation, is dropped without freeing that slot: it is the
new occupant's (``index.evict_batch``).

Ties: the lifecycle owns one ``Evictor`` and calls it; this module calls the index kernels,
the allocator and the lifecycle's counters (``StoreStats``), and nothing of the lifecycle.
"""
from __future__ import annotations

import time

import numpy as np

import tract_kernels as K

from .. import crashpoints as CP
from ..region import Region
from ..region import index as ix
from ..region.alloc import (A_CHUNK, A_GEN, A_NBYTES, A_OFFSET, A_OWNER, A_SLOT, A_SLOT_BYTES,
                            A_TOKEN, Allocation, Allocator)
from ..region.chunks import alloc_geometry

VICTIM_SAMPLE = 16
"""Entries an LRU eviction samples per victim (``index.evict_lru_batch``)."""


class Evictor:
    """Evicts entries of one node (its lane ``lane``) in one region and frees their payloads;
    counts into ``stats`` (the lifecycle's ``StoreStats``)."""

    def __init__(self, region: Region, index: ix.PrefixIndex, allocator: Allocator,
                 layout: object, stats: object, *, lane: int, node_id: int) -> None:
        self.region = region
        self.index = index
        self.geo = index.geo
        self.alloc = allocator
        self.ageo = alloc_geometry(region)
        self.block_bytes = int(layout.block_bytes)     # type: ignore[attr-defined]
        self.stats = stats
        self.lane = lane
        self.node_id = node_id

    @property
    def mem(self) -> K.Mem:
        return self.region.mem

    def lru(self, k: int, *, only_own: bool = False) -> int:
        """Evict up to ``k`` sampled-LRU victims, this node's own blocks first (only they free
        its slots; ``only_own``: no other node's), and free their payloads; how many. Under
        the lock."""
        info = np.zeros((k, 6), dtype=np.int64)
        g = self.geo
        n = int(ix.evict_lru_batch(self.mem, g.header_offset, g.entries_offset,
                                   self.index.tgeo, g.capacity, g.lanes, self.lane,
                                   VICTIM_SAMPLE, time.time_ns(), k, self.node_id, only_own,
                                   info))
        if n:
            if CP.ARMED:
                CP.hit("evict.tombstoned")
            self.free_payloads(info[:n, 1:])
            self._count_for_space(n)
        return n

    def windows(self, words: np.ndarray) -> int:
        """For each key, evict the least recently used of this lane's READY entries in its
        probe window (``index.evict_window_batch``) and free their payloads; how many. Under
        the lock: others may evict READY entries of any lane."""
        g = self.geo
        info = np.zeros((words.shape[0], 6), dtype=np.int64)
        n = int(ix.evict_window_batch(self.mem, g.entries_offset, self.index.tgeo,
                                      self.index.mask, g.max_probe, g.lanes, self.lane, words,
                                      time.time_ns(), info))
        if n:
            self.free_payloads(info[:n, 1:])
            self._count_for_space(n)
        return n

    def _count_for_space(self, n: int) -> None:
        self.index.bump_counter(self.lane, ix.LN_EVICTIONS, n)
        self.stats.evictions += n                   # type: ignore[attr-defined]
        self.stats.evictions_for_space += n         # type: ignore[attr-defined]

    def slots(self, slots: list[int], *, count: bool = True,
              new_state: int = ix.TOMBSTONE) -> None:
        """Set entries to ``new_state`` (a tombstone by default), then free their payloads, as
        one batch; ``count``: as evictions. Under the lock, or without it for entries of this
        node's own lane that are not READY (module docstring)."""
        if not slots:
            return
        info = np.zeros((len(slots), 5), dtype=np.int64)
        g = self.geo
        ix.evict_batch(self.mem, g.entries_offset, self.index.tgeo, self.index.mask, g.lanes,
                       self.lane, np.asarray(slots, dtype=np.int64), new_state, info)
        if count:
            self.index.bump_counter(self.lane, ix.LN_EVICTIONS, len(slots))
            self.stats.evictions += len(slots)      # type: ignore[attr-defined]
        if CP.ARMED:
            CP.hit("evict.tombstoned")
        self.free_payloads(info)

    def free_payloads(self, info: np.ndarray) -> None:
        """Free the payload slots of evicted entries: rows (offset, nbytes, owner word, token,
        slot is the entry's). A stale entry's slot (tag names another reservation) is not
        freed: it is the new occupant's (``index.evict_batch``)."""
        mine = info[:, 4] != 0
        self.stats.stale_entries_dropped += int(np.count_nonzero(~mine))  # type: ignore[attr-defined]
        rows = self.payload_rows(info)
        if len(rows):
            self.alloc.free_rows(rows)

    def payload_rows(self, info: np.ndarray) -> np.ndarray:
        """The allocation rows (``alloc.A_*``) of entries' payloads, built with numpy (a full
        cache evicting 2048 blocks for a 128 MiB put spent ~10-20 ms under the lock building
        an Allocation per block on the VM): ``info`` rows (offset, nbytes, owner word, token,
        slot is the entry's); stale rows (last column 0) and payloads that are not a block
        slot of this region are left out."""
        g = self.ageo
        poff, pnb = info[:, 0], info[:, 1]
        bb = self.block_bytes
        end = g.chunks_offset + g.nchunks * g.chunk_bytes
        sel = info[(info[:, 4] != 0) & (pnb == bb) & (poff >= g.chunks_offset)
                   & (poff <= end - bb)]
        sb = self.alloc.class_for(bb)
        chunk = (sel[:, 0] - g.chunks_offset) // g.chunk_bytes
        rows = np.empty((len(sel), len(Allocation._fields)), dtype=np.int64)
        rows[:, A_OFFSET] = sel[:, 0]
        rows[:, A_NBYTES] = sel[:, 1]
        rows[:, A_SLOT_BYTES] = sb
        rows[:, A_OWNER] = sel[:, 2] & 0xFFFF
        rows[:, A_CHUNK] = chunk
        rows[:, A_SLOT] = (sel[:, 0] - (g.chunks_offset + chunk * g.chunk_bytes)) // sb
        rows[:, A_GEN] = sel[:, 2] >> 16
        rows[:, A_TOKEN] = sel[:, 3]
        return rows
