"""Heartbeats as a coroutine: the liveness every lock and allocator decision rests on."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np


async def heartbeat_forever(region, node_handle, *, interval_s: float) -> None:  # noqa: ANN001
    """Beat ``node_handle`` every ``interval_s`` until cancelled.

    Use at most a quarter of the liveness timeout: a manager stops granting once its own beat is
    older than half the timeout (``manager.py``). Raises NodeEvicted when the id was taken over.

    The beats come from a dedicated thread running ``NodeTable.beat_until_stopped`` (jitted,
    without the GIL), not from this coroutine's loop: a loop blocked by a long synchronous call
    (a first-call Numba compile takes seconds on a cold cache) would otherwise let the node be
    judged dead and its lock revoked. Cancelling this coroutine stops the thread and waits for
    it (at most ~10 ms), so the region can be closed right after.
    """
    stop = np.zeros(1, dtype=np.uint64)               # alive until the thread has returned
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tract-heartbeat")
    beating = asyncio.get_running_loop().run_in_executor(
        pool, region.nodes.beat_until_stopped, node_handle, interval_s, stop)
    try:
        await asyncio.shield(beating)
    finally:
        stop[0] = 1
        await asyncio.shield(asyncio.wait([beating]))
        pool.shutdown(wait=False)
