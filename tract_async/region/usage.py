"""Usage lines for ``tract region inspect``: lock holders, the manager, chunk use per node."""
from __future__ import annotations

from ..errors import RootNameNotFound
from .region import Region


def usage_lines(region: Region) -> list[str]:
    """Human lines describing the lock and allocator state (empty without those sections)."""
    from .fsck import check  # the same fresh reads fsck does; summaries only
    try:
        rep = check(region)
    except RootNameNotFound:
        return []
    lines = ["locks and allocator:"] + [f"  {s}" for s in rep.summary]
    if rep.problems:
        lines.append(f"  ({len(rep.problems)} fsck problem(s): run `tract region fsck`)")
    return lines
