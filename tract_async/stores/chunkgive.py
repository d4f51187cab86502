"""Giving chunks to starving nodes: when another node has asked for chunks and this one owns
more than its fair share, release its least used ones.

A node that finds no chunk of its block size and none free records an ask in the chunk table
(``region/alloc.py``, "Starving") instead of evicting other nodes' blocks. Owners answer it
here, under the global lock: while this node owns more than its fair share (chunks / live
nodes), it evicts the blocks of its least used chunks, none with a put of its own in flight, and
releases them (``Allocator.release_empty_locked``). Its spare slots go back to the free lists
first: they keep chunks from being empty. Reservations look at the asks at most every
``GIVE_CHECK_S`` (``check_passes``); maintenance and the pre-claim task look each round.

Ties: owned and called by the block lifecycle (``stores/blocks.py``), which passes the chunks of
its puts in flight; calls the node table, the allocator, the index, the ``Evictor`` and the
``Spares``, and nothing of the lifecycle.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..region import Region
from ..region import index as ix
from ..region.alloc import Allocator
from ..region.chunks import alloc_geometry
from ..sync.lock import GlobalLock
from .eviction import Evictor
from .spares import Spares

GIVE_CHECK_S = 0.05
"""A reservation looks at other nodes' asks for chunks at most this often. Reading every
node's count line fresh cost ~24 us of a 133 us 64 KiB put on the 2-core VM when done on every
batch, and 83-156 µs of a whole prompt's put start there (213 blocks: ~10 % of it; cold, the
same look alone takes 17): at 5 ms every whole prompt paid it (``bench/results/
vm-20261207-s51/wp_stages.log``). An asker waits up to ``reservation.CHUNK_WAIT_S`` (2 s) and
maintenance looks every round (50 ms or more) as well, so 50 ms here cost it nothing."""


class ChunkGiver:
    """Answers other nodes' asks for chunks for one node (``node_id``) of one region."""

    def __init__(self, region: Region, allocator: Allocator, index: ix.PrefixIndex,
                 lock: GlobalLock, evictor: Evictor, spares: Spares, stats: object, *,
                 node_id: int, liveness_timeout_s: float) -> None:
        self.region = region
        self.alloc = allocator
        self.index = index
        self.lock = lock
        self.evictor = evictor
        self.spares = spares
        self.stats = stats
        self.node_id = node_id
        self.liveness_timeout_s = liveness_timeout_s
        self.ageo = alloc_geometry(region)
        self._check_at = 0.0                # next look at others' asks (monotonic)

    def others_ask(self) -> bool:
        """Another node has asked for chunks (a lock-free read of the asks) and this node owns
        more than one: maintenance then takes the lock to consider giving some."""
        if len(self.alloc.owned_chunks()) < 2:
            return False
        return self.alloc.table.asks_other_than(self.node_id)

    def due(self) -> bool:
        """True at most every ``GIVE_CHECK_S`` (and at the next call after ``check_passes``
        found an ask): time to look at the asks, or, under the lock, to give."""
        t = time.monotonic()
        if t >= self._check_at:
            self._check_at = t + GIVE_CHECK_S
            return True
        return False

    def check_passes(self) -> bool:
        """False when it is time to look at other nodes' asks (``due``) and some node asks:
        the locked path then gives them chunks (at once: ``due`` is true again)."""
        if self.due() and self.others_ask():
            self._check_at = 0.0
            return False
        return True

    def give_locked(self, busy_chunks: Callable[[], set[int]]) -> int:
        """Release chunks to the nodes that asked (module docstring); ``busy_chunks()``: the
        chunks of this node's puts in flight, never given. Returns the chunks released. Caller
        holds the lock."""
        table = self.alloc.table
        wanted = table.wanted()
        wanted[self.node_id] = 0
        if not wanted.any():
            return 0
        nodes = self.region.nodes.all(timeout_s=self.liveness_timeout_s)
        askers = [n for n in np.flatnonzero(wanted).tolist() if n < len(nodes) and not nodes[n].dead]
        if not askers:
            return 0
        use = self.alloc.chunk_use()
        live = 1 + sum(1 for n in nodes if not n.dead and n.node_id != self.node_id)
        fair = max(1, self.ageo.nchunks // live)
        spare = min(len(use) - fair, int(sum(wanted[n] for n in askers)))
        if spare <= 0:
            return 0
        self.spares.drop()                  # they keep chunks from being empty
        busy = busy_chunks()
        pick = [c for c, _ in sorted(use.items(), key=lambda cu: cu[1]) if c not in busy][:spare]
        if not pick:
            return 0
        g = self.ageo
        table_ix = self.index.scan()
        live_e = (table_ix[:, 0] == ix.READY)
        inside = np.zeros(len(table_ix), dtype=np.bool_)
        for c in pick:
            start = g.chunk_off(c)
            inside |= live_e & (table_ix[:, 1] >= start) & (table_ix[:, 1] < start + g.chunk_bytes)
        victims = np.flatnonzero(inside).tolist()
        if victims:
            self.evictor.slots(victims)
            self.stats.evictions_for_others += len(victims)   # type: ignore[attr-defined]
        done = self.alloc.release_empty_locked(pick, self.lock)
        self.stats.chunks_given += len(done)                  # type: ignore[attr-defined]
        return len(done)
