"""The manager line and the candidates' scan stamps, read side (``sync/manager.py`` writes them).

Why a module of its own: the lock's diagnosis (``sync/lock.py``) and ``fsck`` read who manages
the lock, and the manager (``sync/manager.py``) runs the lock's scan slices; with these readers
inside the manager, the lock and the manager imported each other (an import cycle, issue 37).
Byte layouts: the manager line is ``region/layout.py``'s ``MANAGER``; a candidate line (one per
node, ``LockGeometry.cand_off``) holds, at these byte offsets:

| offset | field | written by |
|---|---|---|
| 0 | ``choosing`` (bakery) | the candidate |
| 8 | ``number`` (bakery ticket) | the candidate |
| 16 | ``candidate`` (1 while the node takes part in elections, 0 once it left) | the candidate |
| 24 | ``cand_epoch`` (its incarnation) | the candidate |
| 32 | ``scan_ns`` (wall clock of its last scan while it manages) | the node, every slice |
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import tract_kernels as K

from ..region import layout as L
from ..region.nodes import NodeInfo
from . import slots as S

S_CAND_READ = K.site("lock.election.candidate.invalidate")
S_MGR_READ = K.site("lock.election.manager.invalidate")

CHOOSING, NUMBER, CANDIDATE, CAND_EPOCH, SCAN_NS = 0, 8, 16, 24, 32


@dataclass(frozen=True, kw_only=True)
class ManagerInfo:
    """The manager line as read from memory."""
    node_id: int | None
    term: int
    epoch: int
    since_ns: int


def read_manager(region, geo: S.LockGeometry | None = None,  # noqa: ANN001
                 mem: K.Mem | None = None) -> ManagerInfo:
    """The manager line of ``region`` (fresh from memory)."""
    geo = geo or S.geometry(region)
    raw = np.zeros(64, dtype=np.uint8)
    K.read_bytes(mem if mem is not None else region.mem, geo.manager_offset, raw.ctypes.data, 64, S_MGR_READ)
    rec = raw.view(L.MANAGER.dtype)[0]
    mgr = int(rec["manager"])
    return ManagerInfo(node_id=mgr - 1 if mgr else None, term=int(rec["term"]),
                       epoch=int(rec["epoch"]), since_ns=int(rec["since_ns"]))


def manager_valid(info: ManagerInfo, nodes: list[NodeInfo], *, scan_ns: int | None = None,
                  timeout_s: float | None = None) -> bool:
    """True while the recorded manager's node is not dead (``NodeInfo.dead``) and has the
    recorded epoch; with ``scan_ns`` (the manager node's candidate stamp) and ``timeout_s``,
    also only while that stamp is younger than ``timeout_s`` (not stalled)."""
    if info.node_id is None or info.node_id >= len(nodes):
        return False
    n = nodes[info.node_id]
    if n.dead or n.epoch != info.epoch:
        return False
    if scan_ns is not None and timeout_s is not None:
        return time.time_ns() - scan_ns < timeout_s * 1e9
    return True


def read_scan_ns(region, node_id: int, geo: S.LockGeometry | None = None,  # noqa: ANN001
                 mem: K.Mem | None = None) -> int:
    """The ``scan_ns`` stamp of ``node_id``'s candidate line (fresh from memory)."""
    geo = geo or S.geometry(region)
    return int(K.load_fresh(mem if mem is not None else region.mem,
                            geo.cand_off(node_id) + SCAN_NS, S_CAND_READ))
