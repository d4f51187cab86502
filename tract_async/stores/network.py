"""The network store of an engine's ``transport``: which class serves it.

Why a module of its own: ``stores/nixl.py`` subclasses ``stores/http.py``'s store, so a factory
inside ``http.py`` that names the NIXL store made the two modules import each other (an import
cycle, issue 37). Here both are leaves; ``nixl`` is imported only when asked for (it imports the
``nixl`` package).
"""
from __future__ import annotations

from ..config import EngineConfig
from .http import HttpStore


def network_store(cfg: EngineConfig, *, region_uuid: str | None) -> HttpStore:
    """The store of ``cfg.transport``: HttpStore, or NixlStore (which imports nixl).
    Raises NixlUnavailable, NixlError (NIXL could not start)."""
    if cfg.transport == "nixl":
        from .nixl import NixlStore
        return NixlStore(cfg, region_uuid=region_uuid)
    return HttpStore(cfg, region_uuid=region_uuid)
