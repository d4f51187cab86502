"""tract_async: asyncio-first KV-cache transfer and rack-wide prefix cache over shared memory.

    import tract_async as tract
    layout = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128)
    cfg = tract.EngineConfig(region="/dev/shm/tract-demo", region_bytes=1 << 30, create=True,
                             node_id=0, layout=layout, namespace="llama3-8b")
    async with tract.Engine.open(cfg) as eng:
        ...

Importing this package has no side effects (no mapping, no JIT until first use).
"""
from .config import EngineConfig, KVLayout
from .engine import Engine, run
from .errors import TractError
from .keys import BlockKey, KeyScheme, Namespace

__all__ = ["BlockKey", "Engine", "EngineConfig", "KVLayout", "KeyScheme", "Namespace",
           "TractError", "run"]
__version__ = "0.1.0"
