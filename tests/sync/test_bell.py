"""The manager's bell (``sync/bell.py``): an idle lock manager sleeps on a socket between its
looks at the region; a requester on its host rings it, one that cannot ring is still granted
at the next look, and the idle manager no longer wakes thousands of times a second."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

import tract_async as tract
from tests.support.engine_util import cfg, until
from tract_async.sync import bell as B
from tract_async.sync.lock import GlobalLock


async def _idle_manager(eng: tract.Engine) -> None:
    """Wait until ``eng`` manages the lock and has slept on its bell (idle past BELL_AFTER_S)."""
    mgr = eng._manager
    assert await until(lambda: mgr.is_manager, 10.0), "node 0 never became the manager"
    assert await until(lambda: mgr.statistics().bell_sleeps > 0, 10.0), "it never slept"


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_a_ring_wakes_the_idle_manager(region_path: str, backend: str) -> None:
    """A request from another node of the host rings the bell: the manager's sleep ends by a
    ring (not its timeout) and the lock is granted; the release rings it again."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as a, \
            tract.Engine.open(cfg(region_path, 1, backend=backend)) as b:
        await _idle_manager(a)
        mgr = a._manager
        for _ in range(3):
            await asyncio.sleep(3 * B.BELL_AFTER_S)      # idle again: asleep on the bell
            heard = mgr.statistics().bell_rings
            sent = b._lock._bell.rings
            await b._lock.acquire(timeout=5.0)
            b._lock.release()
            assert b._lock._bell.rings == sent + 2       # the request and the release
            assert await until(lambda: mgr.statistics().bell_rings > heard, 10.0)


async def test_a_requester_that_cannot_ring_is_granted_by_the_next_look(
        region_path: str) -> None:
    """A requester on another host cannot reach the bell: the manager sees its request at its
    next look, at most BELL_WAIT_MS after (no ring heard meanwhile)."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a, \
            tract.Engine.open(cfg(region_path, 1)) as b:
        await _idle_manager(a)
        mgr = a._manager
        far = GlobalLock(b._region, b._handle)
        far._bell.name = b"\0tract-mgr-on-another-host-" + os.urandom(8).hex().encode()
        try:
            await asyncio.sleep(3 * B.BELL_AFTER_S)      # idle: asleep on the bell
            heard = mgr.statistics().bell_rings
            await far.acquire(timeout=5.0)
            far.release()
            assert far._bell.rings == 0
            assert mgr.statistics().bell_rings == heard   # nobody rang: a timeout's look saw it
        finally:
            far.close()


def _switches_per_s(seconds: float) -> float:
    """Context switches per second of every thread of this process over ``seconds``."""
    def total() -> int:
        n = 0
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/status") as f:
                    for line in f:
                        if line.startswith(("voluntary_ctxt_switches",
                                            "nonvoluntary_ctxt_switches")):
                            n += int(line.split()[1])
            except OSError:
                pass
        return n
    a = total()
    time.sleep(seconds)
    return (total() - a) / seconds


async def _idle_switches(path: str) -> float:
    async with tract.Engine.open(cfg(path, 0, create=True)) as a:
        assert await until(lambda: a._manager.is_manager, 10.0), "node 0 never managed"
        await asyncio.sleep(3 * B.BELL_AFTER_S)
        return await asyncio.get_running_loop().run_in_executor(None, _switches_per_s, 1.0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
async def test_an_idle_manager_wakes_rarely(region_path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle, the managing process wakes a few hundred times a second (the bell's timeout, the
    heartbeat, the manager's slices), not thousands (a 100 µs poll). Negative control: a
    manager that never goes to the bell (BELL_AFTER_S beyond the test) wakes at the poll's
    rate in the same process."""
    with_bell = await _idle_switches(region_path)
    monkeypatch.setattr("tract_async.sync.manager.BELL_AFTER_S", 3600.0)
    without = await _idle_switches(region_path + "-nobell")
    assert with_bell < 0.25 * without, (with_bell, without)
    assert with_bell < 2500, with_bell


async def test_an_idle_managers_slices_are_long_unless_the_lock_is_held(
        region_path: str) -> None:
    """Asleep on its bell with no lock held, the manager's scan slices last
    ``ManagerPolicy.idle_slice_s`` (the Python between slices is most of an idle engine's
    cost); while a node holds the lock they stay ``slice_s`` long, so that a dead holder is
    revoked as promptly as before."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a, \
            tract.Engine.open(cfg(region_path, 1)) as b:
        await _idle_manager(a)
        mgr = a._manager

        async def slices_in(seconds: float) -> float:
            s0 = mgr.statistics().slices
            await asyncio.sleep(seconds)
            return (mgr.statistics().slices - s0) / seconds
        idle = await slices_in(1.0)
        await b._lock.acquire(timeout=5.0)
        try:
            await asyncio.sleep(3 * B.BELL_AFTER_S)     # idle again, with the lock held
            held = await slices_in(1.0)
        finally:
            b._lock.release()
    pol = mgr.policy
    idle_s = min(pol.idle_slice_s, mgr.liveness_timeout_s / 16)
    assert idle_s >= 4 * pol.slice_s, (idle_s, pol.slice_s)      # what the test tells apart
    assert idle <= 1.5 / idle_s, (idle, held)
    assert held >= 2 * idle and held >= 0.5 / pol.slice_s, (idle, held)


def test_a_second_bell_on_one_region_does_not_bind() -> None:
    """One bell per region name: a manager whose predecessor still holds it polls instead."""
    class R:
        uuid = __import__("uuid").uuid4()
    first, second = B.ManagerBell(R()), B.ManagerBell(R())
    try:
        assert first.open() >= 0
        assert second.open() == -1
    finally:
        first.close()
        second.close()
    assert B.ManagerBell(R()).name == first.name      # the name is the region's, not the bell's
