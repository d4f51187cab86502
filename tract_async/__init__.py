"""tract_async: asyncio-first KV-cache transfer and rack-wide prefix cache over shared memory.

    import tract_async as tract
    layout = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128)
    cfg = tract.EngineConfig(region="/dev/shm/tract-demo", region_bytes=1 << 30, create=True,
                             node_id=0, layout=layout, namespace="llama3-8b")
    async with tract.Engine.open(cfg) as eng:
        ...

Importing this package has no side effects (no mapping, no JIT until first use) and imports
nothing heavy: the public names are resolved on first use (PEP 562). Why: ``tract --help`` and
``tract region inspect`` need neither torch nor Numba, and importing torch alone takes about a
second on a small machine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _kernels_name

_kernels_name.install()    # before anything imports transformers (that module says why)

_EXPORTS: dict[str, str] = {
    "BlockKey": "keys",
    "Engine": "engine",
    "EngineConfig": "config",
    "KVLayout": "config",
    "KeyScheme": "keys",
    "Namespace": "keys",
    "TractError": "errors",
    "run": "engine",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tract_async' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tract_async.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from tract_async.config import EngineConfig, KVLayout
    from tract_async.engine import Engine, run
    from tract_async.errors import TractError
    from tract_async.keys import BlockKey, KeyScheme, Namespace
