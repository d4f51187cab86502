"""What the node table and the root directory read of their region while they run: its memory.

``Region`` builds both (``region.nodes``, ``region.root``). They used to take the Region itself,
so ``region`` imported ``nodes`` and ``rootdir`` (lazily, inside ``Region.__init__``) while they
imported ``region`` back for its type (issue 16). Now they take what they need, and the imports
go one way, ``region`` -> ``nodes``, ``rootdir`` -> ``memview``:

* the geometry (offsets, counts, the region's size and path), as numbers: fixed once the header
  is read;
* the memory view, through this Protocol, read on every access and never kept: with the sim
  backend each thread gets its own view, and the owner's may be replaced (fault injection,
  ``Region.mem``'s setter). ``Region`` satisfies it as it is.
"""
from __future__ import annotations

from typing import Protocol

import tract_kernels as K

__all__ = ["MemView"]


class MemView(Protocol):
    """Something with the calling thread's kernel view of a mapped region (``Region``)."""

    @property
    def mem(self) -> K.Mem | None:
        """The view for the kernels (None once the region is closed)."""
