"""Waiting for work that cannot be interrupted, through cancellations of the waiter.

A copy running on threads or workers, a DMA, a step of an engine's close: once started, they
run to their end whatever happens to the task that waits for them, and that task must not
move on (free the memory, unmap the region, skip the rest of a teardown) before they have
ended (docs/design.md invariant 7). ``settled`` is that wait: it returns once every future is
done, however often the waiter is cancelled meanwhile, and says whether it was, so that the
caller re-raises the cancellation when it is ready to. It neither raises nor retrieves the
futures' own outcomes: each caller decides what they mean.
"""
from __future__ import annotations

import asyncio
from typing import Any


async def settled(*futs: "asyncio.Future[Any]") -> bool:
    """Wait until every one of ``futs`` is done, through cancellations of the caller. Returns
    True when the caller was cancelled meanwhile (it owes that cancellation to its own caller)."""
    cancelled = False
    while not all(f.done() for f in futs):
        try:
            await asyncio.wait(futs)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled
