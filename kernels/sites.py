"""Named flush / invalidate sites, for fault injection.

Every flush or invalidate in a protocol passes a *site id*. A ``Mem`` built with
``skip_site=<id>`` silently omits exactly that one site, which is how the tests prove that each
flush and invalidate is necessary: remove it, run the scenario under the incoherent backend, and
watch it fail (docs/design.md invariant 4).

Ids are derived from the name (CRC-32), not from registration order: Numba freezes module-level
integers into compiled (and cached) code, so an id must be the same in every process and run.

An id is a NumPy ``int64``, not a Python ``int``: Numba types a global ``int`` as a literal, and
a kernel called with a literal argument is compiled once per value -- the word kernels once per
site (``flush`` 18 times, its hardware and sim halves 36 times each, ``invalidate`` 19): about
a fifth of the warm-up's compile time (``bench/results/vm-20261207-s52/README.md``). A global
``int64`` is typed ``int64``: one compile serves every site, and the caller's machine code holds
the id as a constant all the same (the word kernels are inlined, ``mem.py``), so a removed site's
check still folds away.
"""
from __future__ import annotations

import zlib

import numpy as np

NO_SITE: int = -2
"""Passed where a flush is structural (not a protocol step) and may never be skipped.

Distinct from ``SKIP_NONE`` (-1), the Mem value that omits nothing."""

SKIP_NONE: int = -1

_REGISTRY: dict[int, str] = {}


def site(name: str) -> np.int64:
    """Register a site name and return its stable id. Raises ValueError on a hash collision."""
    site_id = zlib.crc32(name.encode()) & 0x7FFFFFFF
    prev = _REGISTRY.get(site_id)
    if prev is not None and prev != name:
        raise ValueError(f"site id collision: {name!r} and {prev!r}")
    _REGISTRY[site_id] = name
    return np.int64(site_id)


def registered(prefix: str = "") -> dict[str, int]:
    """All registered sites whose name starts with ``prefix`` (import the protocol module first)."""
    return {name: sid for sid, name in sorted(_REGISTRY.items(), key=lambda kv: kv[1])
            if name.startswith(prefix)}


def name_of(site_id: int) -> str:
    """The name registered for ``site_id`` (``"<none>"`` for NO_SITE)."""
    return "<none>" if site_id in (NO_SITE, SKIP_NONE) else _REGISTRY.get(site_id, f"<unknown {site_id}>")
