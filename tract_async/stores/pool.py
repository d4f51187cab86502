"""The local block pool of the HTTP transport: one CPU tensor carved into block slots.

An engine without a shared region (or whose region is full, or whose peer lives in another
rack) keeps the blocks it produces here and registers the pool with its Agent, so that peers
READ them by descriptor. Slot ``s`` holds one block at byte ``s * block_bytes``, layer-major like
a block in the region (for layer l: K then V), so one layer of a block is one contiguous range.

Versions. Every reservation gets a fresh version from one per-pool counter (never reused), and
eviction forgets it. A reader that saw ``(key, slot, version)`` and finds the same triple after
its copy knows that nobody evicted the block (and so nobody rewrote the slot) in between: the
same re-validation the region path does with its entry versions (docs/design.md invariant 6). Only
the event loop touches this structure, so a local copy made without an ``await`` needs no
check; a remote READ (which spans awaits on the server) is checked with ``holds()``.

Lifetime. Cache mode: complete blocks are evicted least recently used first when a put needs
room; blocks still being filled are never evicted. Transfer mode: a block lives until its
consumer has read it (``evict``) or its deadline passes (``expired``); nothing is evicted for
space (a put that does not fit raises RegionFull, like the region).
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict

from ..arrays import require_torch
from ..config import KVLayout
from ..errors import RegionFull

torch = require_torch("the network store's block pool")


@dataclasses.dataclass
class LocalBlock:
    """One block of this node's pool."""
    slot: int
    version: int
    mask: int = 0                 # layers landed (bit l = layer l)
    complete: bool = False
    deadline_ns: int = 0          # transfer mode: freed after this (time.monotonic_ns)


class BlockPool:
    """Slots, a free list, versions and LRU order of this node's HTTP-served blocks."""

    def __init__(self, layout: KVLayout, pool_bytes: int, *, mode: str, deadline_s: float,
                 device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.nslots = pool_bytes // layout.block_bytes
        if self.nslots < 1:
            raise RegionFull(f"an HTTP pool of {pool_bytes} bytes holds no {layout.block_bytes}-byte "
                             f"block; raise http_pool_bytes")
        self.bytes = torch.zeros(self.nslots * layout.block_bytes, dtype=torch.uint8, device=device)
        L, T, H, D = layout.num_layers, layout.block_tokens, layout.kv_heads, layout.head_dim
        self.blocks = self.bytes.view(layout.dtype).view(self.nslots, L, 2, T, H, D)
        self.mode = mode
        self.deadline_s = deadline_s
        self._free = list(range(self.nslots - 1, -1, -1))   # pop() hands out slot 0 first
        self._held: OrderedDict[bytes, LocalBlock] = OrderedDict()   # LRU order: oldest first
        self._next_version = 1
        self.full_mask = (1 << layout.num_layers) - 1

    # -- queries (never block) ----------------------------------------------------------------
    def get(self, key: bytes) -> LocalBlock | None:
        return self._held.get(key)

    def holds(self, key: bytes, slot: int, version: int, layer: int | None) -> bool:
        """Does ``slot`` still hold ``key`` at ``version`` with ``layer`` (all layers: None)?"""
        b = self._held.get(key)
        if b is None or b.slot != slot or b.version != version:
            return False
        return b.complete if layer is None else bool((b.mask >> layer) & 1)

    def items(self) -> list[tuple[bytes, LocalBlock]]:
        return list(self._held.items())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def reserved(self) -> list[bytes]:
        return [k for k, b in self._held.items() if not b.complete]

    # -- changes ------------------------------------------------------------------------------
    def reserve(self, keys: list[bytes]) -> tuple[list[LocalBlock], list[tuple[bytes, LocalBlock]]]:
        """Slots for ``keys`` (all or nothing), evicting LRU complete blocks in cache mode.

        Returns (the new blocks, the blocks evicted for space). Raises RegionFull.
        """
        need = len(keys) - len(self._free)
        victims: list[bytes] = []
        if need > 0 and self.mode == "cache":
            for k, b in self._held.items():      # oldest first
                if len(victims) == need:
                    break
                if b.complete:
                    victims.append(k)
        if len(self._free) + len(victims) < len(keys):
            raise RegionFull(f"the HTTP pool has {len(self._free)} free of {self.nslots} slots and "
                             f"{len(victims)} evictable blocks; {len(keys)} blocks do not fit "
                             f"(mode={self.mode!r}; raise http_pool_bytes)")
        evicted = [(k, self.evict(k)) for k in victims]
        deadline = (time.monotonic_ns() + int(self.deadline_s * 1e9)
                    if self.mode == "transfer" else 0)
        out = []
        for k in keys:
            b = LocalBlock(slot=self._free.pop(), version=self._next_version, deadline_ns=deadline)
            self._next_version += 1
            self._held[k] = b
            out.append(b)
        return out, [(k, b) for k, b in evicted if b is not None]

    def land(self, key: bytes, mask: int) -> LocalBlock:
        """Record that the layers in ``mask`` of ``key`` landed (the bytes are already there)."""
        b = self._held[key]
        b.mask |= mask
        b.complete = b.mask == self.full_mask
        return b

    def touch(self, key: bytes) -> None:
        if key in self._held:
            self._held.move_to_end(key)

    def evict(self, key: bytes) -> LocalBlock | None:
        """Forget ``key``; its slot is free again (its version is never handed out again)."""
        b = self._held.pop(key, None)
        if b is not None:
            self._free.append(b.slot)
        return b

    def expired(self, now_ns: int) -> list[bytes]:
        if self.mode != "transfer":
            return []
        return [k for k, b in self._held.items() if b.deadline_ns and b.deadline_ns <= now_ns]
