"""Heartbeats as a coroutine: the liveness every lock and allocator decision rests on."""
from __future__ import annotations

import asyncio


async def heartbeat_forever(region, node_handle, *, interval_s: float) -> None:  # noqa: ANN001
    """Beat ``node_handle`` every ``interval_s`` until cancelled.

    Use at most a quarter of the liveness timeout: a manager stops granting once its own beat is
    older than half the timeout (``manager.py``). Raises NodeEvicted when the id was taken over.
    """
    while True:
        region.nodes.heartbeat(node_handle)
        await asyncio.sleep(interval_s)
