"""Spare payload slots: block slots a node takes from its free lists ahead of need.

A fused put (``fused.put_blocks``: reserve, copy and publish a few whole blocks in one kernel
call, no lock) needs its payload slots in hand, as rows the kernel reads. Taking them from the
allocator one put at a time cost ~10-20 µs of Python per put; so they are taken ``SPARE_SLOTS``
at a time and kept here, with their kernel rows (``info``: offset, nbytes, owner word, token)
kept in step. Spares are this node's allocated slots that hold nothing: a locked reservation
takes them first, and they go back to the free lists before chunks are released (``drop``).

Ties: owned and called by the block lifecycle (``stores/blocks.py``); calls the allocator.
"""
from __future__ import annotations

import numpy as np

from ..region.alloc import Allocation, Allocator

SPARE_SLOTS = 16
"""Payload slots a fused put takes from the free lists at a time: one allocator call (~10-20
µs of Python) per this many small puts instead of one per put. The cost: this many blocks'
worth of a node's chunks held for it (1 MiB of 64 KiB blocks)."""


def alloc_info(a: Allocation) -> tuple[int, int, int, int]:
    """An allocation as a reservation's kernel takes it: (payload offset, nbytes, owner word,
    token); the owner word is the owner node with the chunk generation above bit 16, as an
    index entry stores it (``BlockLifecycle.allocation_of`` decodes it)."""
    return (a.offset_bytes, a.nbytes, a.owner_node | (a.generation << 16), a.token)


class Spares:
    """This node's spare slots, newest on top; the top ``len(self)`` rows of ``info`` are
    theirs, in the same order."""

    def __init__(self, allocator: Allocator, block_bytes: int, capacity: int) -> None:
        self.alloc = allocator
        self.block_bytes = block_bytes
        self.allocs: list[Allocation] = []
        """The spares, newest last. Read-only for callers (the fused put reads its length and
        pops what the kernel used: a method call there cost more than the read)."""
        self.info = np.zeros((capacity, 4), dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.allocs)

    def take(self, count: int) -> list[Allocation]:
        """Up to ``count`` spare slots, now the caller's."""
        k = min(count, len(self.allocs))
        if k == 0:
            return []
        out = self.allocs[-k:]
        del self.allocs[-k:]
        return out

    def add(self, allocs: list[Allocation]) -> None:
        c = len(self.allocs)
        for j, a in enumerate(allocs):
            self.info[c + j] = alloc_info(a)
        self.allocs.extend(allocs)

    def refill(self, need: int) -> bool:
        """Top the spares up to ``SPARE_SLOTS + need`` from the free lists (no lock, no chunk
        claim); True when at least ``need`` are there."""
        want = min(SPARE_SLOTS + need, self.info.shape[0]) - len(self.allocs)
        if want > 0:
            # reversed: spares are taken from the top, so the slot the allocator hands out
            # first (the lowest free, or the one freed last) is used first, as without spares
            got = self.alloc.alloc_many_nowait(self.block_bytes, want)
            self.add(got[::-1])
        return len(self.allocs) >= need

    def settle_top(self, n: int, kept: list[int]) -> None:
        """After a fused put given the top ``n``: those it used are gone; ``kept`` (indices
        among the ``n``: keys it skipped or did not reach) stay spares."""
        c = len(self.allocs)
        if not kept:
            del self.allocs[c - n:]
            return
        allocs = self.allocs[c - n:]
        del self.allocs[c - n:]
        self.add([allocs[j] for j in kept])

    def drop(self) -> None:
        """Give every spare slot back to the free lists (before chunks are released)."""
        if self.allocs:
            allocs, self.allocs = self.allocs, []
            self.alloc.free_many(allocs)
