"""Helpers for engine tests over a network transport: configs and engine pairs on 127.0.0.1.

``TRANSPORT`` is the network transport of ``http_cfg`` / ``http_pair`` when a test names none:
"http", or "nixl" inside tests/transport/test_engine_nixl.py, which reruns the HTTP engine tests over
NIXL by setting it (an autouse fixture there).
"""
from __future__ import annotations

import importlib.util

import pytest

import tract_async as tract
from tests.support.engine_util import TINY

SECRET = b"tract-engine-test-secret-0123456789"
TRANSPORT = "http"

needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None,
    reason="nixl is not installed (pip install --no-deps nixl nixl-cu12; .ci/run installs it)")


def http_cfg(node_id: int, *, peers: tuple[str, ...] | list[str] = (), region: str | None = None,
             layout: tract.KVLayout = TINY, region_bytes: int = 32 << 20, **kw) -> tract.EngineConfig:
    """An engine on an Agent at 127.0.0.1, port 0 (the OS picks), authenticated with SECRET.

    ``region`` set: a region engine with HTTP fallback (``backend`` as in engine_util.cfg)."""
    return tract.EngineConfig(layout=layout, region=region, region_bytes=region_bytes,
                              create=kw.pop("create", False), node_id=node_id,
                              max_nodes=kw.pop("max_nodes", 8), namespace="tiny",
                              mem_backend=kw.pop("backend", "hw"), heartbeat_interval_s=0.05,
                              liveness_timeout_s=kw.pop("liveness_timeout_s", 1.0),
                              chunk_bytes=kw.pop("chunk_bytes", 1 << 20), peers=tuple(peers),
                              listen_host="127.0.0.1", listen_port=0,
                              secret=kw.pop("secret", SECRET),
                              transport=kw.pop("transport", None) or TRANSPORT, **kw)


async def http_pair(**kw) -> tuple[tract.Engine, tract.Engine]:
    """Two network engines; the second names the first as its peer (peering is symmetric)."""
    a = await tract.Engine.open(http_cfg(0, **kw))
    try:
        b = await tract.Engine.open(http_cfg(1, peers=[a.url], **kw))
    except BaseException:
        await a.close()
        raise
    return a, b
