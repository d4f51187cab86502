"""``Store``: the one interface the Engine dispatches every transfer through.

``RegionStore`` (CPU copy and CUDA DMA over the shared region), ``HttpStore`` (the network
agent) and ``FallbackStore`` (region first, network per transfer) implement it, so a CUDA
transfer takes the same path as a CPU one, including the fallback when the region is full.
Arguments are checked by the Engine before a store sees them (``stores/plan.py``): ``keys`` are
32-byte block keys, ``kv``/``out`` arrays of the layout's shape and dtype: torch tensors (CPU or
CUDA) or numpy arrays (``tract_async.arrays``; the network stores need torch).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

KVArray = Any
"""A torch tensor or a numpy array (``tract_async.arrays``)."""


@runtime_checkable
class Store(Protocol):
    """put / get / lookup / maintain of KV blocks (see the module docstring)."""

    def lookup(self, keys: list[bytes]) -> int:
        """Leading keys resident and complete; never blocks."""
        ...

    async def put(self, keys: list[bytes], kv: KVArray, layer: int | None,
                  timeout: float | None) -> int:
        """Store the blocks not yet present (one layer, or all); returns how many were written.
        Raises RegionFull (nothing stored), TransferTimeout."""
        ...

    async def get(self, keys: list[bytes], out: KVArray, layer: int | None,
                  timeout: float | None) -> KVArray:
        """Read the blocks into ``out`` (waiting up to ``timeout`` for them); returns ``out``.
        Raises BlockNotFound, LayerNotReady, TransferTimeout, BlockEvicted."""
        ...

    async def maintain(self, timeout: float) -> None:
        """Periodic housekeeping (LRU touches, expiry, returned slots)."""
        ...
