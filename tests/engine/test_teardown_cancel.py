"""A background task that fails while the engine closes must not cut the close short.

The engine's TaskGroup, aborted by a failing background task (here: the heartbeat's report
that this node was taken over, injected with ``Engine._fail``), cancels the task that opened
it -- the one running ``close``. Before ``Engine._teardown`` ran each step through such a
cancellation, a cancellation landing inside a step (the store's close, the heartbeat's join)
skipped every later one: the TaskGroup never left, the lock and the mapping stayed open, and
the region file stayed in /dev/shm (found while chasing a CI hang, session 45).
"""
from __future__ import annotations

import asyncio
import os

import pytest

import tract_async as tract
from tests.support.engine_util import cfg, kv_for_keys


class Injected(RuntimeError):
    pass


async def test_a_failure_during_close_still_releases_everything(region_path: str) -> None:
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, remove_on_close=True))
    keys = eng.block_keys(list(range(4 * eng.layout.block_tokens)))
    assert await eng.put_kv(keys, kv_for_keys(keys)) == len(keys)
    tasks = list(eng._tasks)
    orig = eng._store.close
    seen: list[str] = []

    async def close_meeting_a_failure(timeout: float) -> None:
        eng._fail(Injected("node taken over (injected)"))
        try:
            await asyncio.sleep(0.5)        # the TaskGroup aborts meanwhile
        except asyncio.CancelledError:
            seen.append("step cancelled")
            raise
        seen.append("step finished")
        await orig(timeout=timeout)

    eng._store.close = close_meeting_a_failure
    with pytest.raises(Injected):
        await eng.close()
    assert seen == ["step finished"], seen
    assert eng._tg is None and eng._lock is None and eng._region is None
    assert all(t.done() for t in tasks), [t for t in tasks if not t.done()]
    assert not os.path.exists(region_path), "the region was not removed on close"
    # the injected failure was the only thing wrong: this task is not left cancelled
    assert asyncio.current_task().cancelling() == 0


async def test_a_cancelled_close_finishes_and_then_raises_the_cancellation(
        region_path: str) -> None:
    """A caller's own cancellation of ``close`` (not the TaskGroup's) is honoured once every
    step has run: CancelledError, with everything released."""
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, remove_on_close=True))
    orig = eng._store.close
    started = asyncio.Event()

    async def slow_close(timeout: float) -> None:
        started.set()
        await asyncio.sleep(0.3)
        await orig(timeout=timeout)

    eng._store.close = slow_close
    closing = asyncio.ensure_future(eng.close())
    await started.wait()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert eng._tg is None and eng._lock is None and eng._region is None
    assert not os.path.exists(region_path)
