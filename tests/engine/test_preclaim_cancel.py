"""The pre-claim task (``stores/preclaim.py``) ends when it is cancelled, also when the
cancellation lands just as the wait for in-flight puts and reads to drain completes.

On Python 3.11, ``asyncio.wait_for`` returns the inner result and drops the caller's
cancellation when both arrive in the same loop turn (fixed in 3.12). The task then went back to
``await self._refill.wait()`` -- no timer, nobody sets it after close -- and an engine's close,
which waits for its TaskGroup's tasks, waited forever: the signature of a CI run's hang of
``test_unsnapshotted_put[sim]`` (600 s in ``epoll_wait`` with no timer scheduled, the heartbeat
and manager threads gone). The interleaving is injected here.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tract_async.stores.preclaim import PreClaimer


class _Host(SimpleNamespace):
    """What ``PreClaimer.run`` touches of its lifecycle: busy while ``in_flight``; closing, so
    that a claim returns at once."""


async def test_cancel_as_the_drain_wait_completes_ends_the_task() -> None:
    host = _Host(in_flight=1, closing=True, cfg=SimpleNamespace(liveness_timeout_s=1.0),
                 layout=SimpleNamespace(block_bytes=1))
    pc = PreClaimer(host, cap_blocks=64)      # type: ignore[arg-type]
    task = asyncio.get_running_loop().create_task(pc.run(), name="tract-preclaim-test")
    try:
        pc._refill.set()                       # a put found the free lists short
        for _ in range(5):                     # the task waits for the put in flight to drain
            await asyncio.sleep(0)
        assert not task.done()
        host.in_flight = 0
        pc.maybe_drained()                     # the put publishes: the wait completes ...
        await asyncio.sleep(0)
        task.cancel()                          # ... and the engine's close cancels the task
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert done, "the pre-claim task lost its cancellation and waits forever"
        assert task.cancelled()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
