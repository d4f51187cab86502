"""The engine's side of the namespace records (``region/namespaces.py``): record this engine's
namespace and KV layout when it opens, and check the namespace of every block a read finds.

Open (``Engine._start_region``). ``check_open`` runs right after the region is mapped, before
the node joins: a record of this namespace (name, rank, world size) with another layout refuses
the open with ``LayoutMismatch``, and nothing in the region has changed. Then, at the engine's
warm-up and holding the global lock, ``record_locked`` writes the record if none is there yet
(and checks again: another engine may have recorded the namespace in between) and returns the
tag this node's index entries carry from then on (``BlockLifecycle.use_layouts``).

Read. The fused and parallel read kernels take only blocks of this node's tag (or untagged
ones, written by no engine); any other block sends the read to the step-by-step path, whose
``prepare_read`` asks ``check_rows`` / ``check_snapshot`` here. A foreign tag is looked up in
the region once: a record of another layout makes the read a ``LayoutMismatch`` naming both
layouts; a record of the same layout is remembered as readable. Such a block has this engine's
shape; the namespace that keys fold in is what keeps two models' blocks apart, and keys that
leave it out (``vllm_compatible_keys``) need one region per model (``keys.py``). Whether a key
of another namespace should be read at all is the caller's business; that its bytes are read
as another layout never is.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..config import EngineConfig
from ..errors import LayoutMismatch
from ..region import layout as L
from ..region.index import SNAP_FLAGS
from ..region.namespaces import NamespaceLayout, NamespaceRecord, NamespaceTable, ns_tag_of

_SHIFT, _MASK = L.INDEX_FLAG_NS_SHIFT, L.INDEX_FLAG_NS_MASK


def layout_of(cfg: EngineConfig) -> NamespaceLayout:
    """The record an engine of ``cfg`` stands for."""
    lay = cfg.layout
    return NamespaceLayout(name=cfg.namespace, rank=cfg.rank, world_size=cfg.world_size,
                           num_layers=lay.num_layers, block_tokens=lay.block_tokens,
                           kv_heads=lay.kv_heads, head_dim=lay.head_dim, dtype=lay.dtype_name,
                           block_bytes=lay.block_bytes)


class LayoutGuard:
    """One engine's namespace record and the read-side check (module docstring)."""

    def __init__(self, region: Any, cfg: EngineConfig) -> None:
        self.table = NamespaceTable.of(region)
        self.mine = layout_of(cfg)
        self.node_id = cfg.node_id
        self._path = region.path
        self.tag = 0
        """This engine's record's tag once recorded (``record_locked``); 0 before."""
        self.readable: set[int] = {0}
        """Tags whose blocks this engine reads: untagged, its own, and same-layout records."""

    def _conflict(self, rec: NamespaceRecord) -> LayoutMismatch:
        return LayoutMismatch(
            f"{self._path}: this engine is {self.mine.describe()}, but the region recorded that "
            f"namespace (node {rec.recorded_by}) as {rec.layout.describe()}: open it with the "
            f"recorded layout, or give this layout another namespace "
            f"(EngineConfig.namespace) or region")

    def check_open(self) -> None:
        """Refuse this engine if the region recorded its namespace with another layout. Takes
        no lock, writes nothing. Raises LayoutMismatch."""
        rec = self.table.find(self.mine.ns_id)
        if rec is not None and rec.layout.geometry() != self.mine.geometry():
            raise self._conflict(rec)

    def record_locked(self) -> int:
        """Record this engine's namespace if the region has no record of it yet; its tag. The
        caller holds the global lock. Raises LayoutMismatch, NamespaceTableFull."""
        rec = self.table.record(self.mine, node_id=self.node_id, holding_lock=True)
        if rec.layout.geometry() != self.mine.geometry():
            raise self._conflict(rec)
        self.tag = rec.tag
        self.readable.add(rec.tag)
        return rec.tag

    def _foreign(self, keys: Sequence[bytes], i: int, tag: int) -> None:
        """Block ``i`` carries ``tag``, not yet known readable: remember it, or raise."""
        rec = self.table.by_tag(tag)
        if rec.layout.geometry() != self.mine.geometry():
            raise LayoutMismatch(
                f"block {i} of {len(keys)} ({bytes(keys[i][:8]).hex()}…) was stored by "
                f"{rec.layout.describe()}; this engine is {self.mine.describe()}: its bytes are "
                f"not of this layout (a key of another namespace was passed to this engine?)")
        self.readable.add(tag)

    def check_rows(self, keys: Sequence[bytes], rows: list[list[int]]) -> None:
        """``check_snapshot`` for a few snapshot rows as Python lists (``prepare_read``'s
        small path). Raises LayoutMismatch, RegionCorrupt (a tag that names no record)."""
        ok = self.readable
        for i, r in enumerate(rows):
            t = (r[SNAP_FLAGS] >> _SHIFT) & _MASK
            if t not in ok:
                self._foreign(keys, i, t)

    def check_snapshot(self, keys: Sequence[bytes], snap: np.ndarray) -> None:
        """Every snapshot row (all present) names a readable namespace. Raises LayoutMismatch,
        RegionCorrupt (a tag that names no record)."""
        tags = (snap[:, SNAP_FLAGS] >> _SHIFT) & _MASK
        if (tags == self.tag).all():
            return
        for i in np.flatnonzero(tags != self.tag).tolist():
            t = ns_tag_of(int(snap[i, SNAP_FLAGS]))
            if t not in self.readable:
                self._foreign(keys, i, t)
