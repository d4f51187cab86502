"""The manager's bell (``sync/bell.py``): an idle lock manager sleeps on a socket between its
looks at the region; a requester on its host rings it, one that cannot ring is still granted
at the next look, and the idle manager no longer wakes thousands of times a second."""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from typing import Iterator

import numpy as np
import pytest

import tract_async as tract
from tests.support.engine_util import cfg, until
from tract_async.region import nodes as nodes_mod
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


@contextlib.contextmanager
def _requester_of_another_host(region, node_id: int) -> Iterator[GlobalLock]:  # noqa: ANN001
    """A node whose line names another host (``host_id`` swapped for its join), beating from a
    thread, and its lock, whose ring cannot reach this host's bell: a requester on another
    host, as the manager sees it."""
    real = nodes_mod.host_id
    nodes_mod.host_id = lambda: 0x7A11_0000_0000_0001
    try:
        h = region.nodes.join(node_id)
    finally:
        nodes_mod.host_id = real
    stop = np.zeros(1, dtype=np.uint64)
    beat = threading.Thread(target=region.nodes.beat_until_stopped, args=(h, 0.05, stop),
                            daemon=True)
    beat.start()
    lock = GlobalLock(region, h)
    lock._bell.name = b"\0tract-mgr-on-another-host-" + os.urandom(8).hex().encode()
    try:
        yield lock
    finally:
        lock.close()
        stop[0] = 1
        beat.join(5.0)
        region.nodes.leave(h)


async def _bell_sleeps_per_s(mgr, seconds: float = 0.5) -> float:  # noqa: ANN001
    s0 = mgr.statistics().bell_sleeps
    await asyncio.sleep(seconds)
    return (mgr.statistics().bell_sleeps - s0) / seconds


async def test_a_requester_on_another_host_is_granted_by_the_next_look(
        region_path: str) -> None:
    """With a live node of another host in the table, the idle manager looks every
    BELL_WAIT_MS (that node cannot ring); its request is granted with no ring heard."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a, \
            tract.Engine.open(cfg(region_path, 1)) as b:
        await _idle_manager(a)
        mgr = a._manager
        with _requester_of_another_host(b._region, 5) as far:
            await asyncio.sleep(3 * B.BELL_AFTER_S)      # idle: asleep on the bell
            rate = await _bell_sleeps_per_s(mgr)
            heard = mgr.statistics().bell_rings
            await far.acquire(timeout=5.0)
            far.release()
            assert far._bell.rings == 0
            assert mgr.statistics().bell_rings == heard   # nobody rang: a timeout's look saw it
    assert rate >= 0.25 * 1000 / B.BELL_WAIT_MS, rate      # ~one look per BELL_WAIT_MS


async def test_with_every_node_local_the_idle_manager_sleeps_until_a_ring(
        region_path: str) -> None:
    """Every live node on this host: the idle scan sleeps on the bell up to its slice's end
    (a sleep per slice, not one per BELL_WAIT_MS), and a same-host requester whose ring does
    not arrive is still granted, at the slice's end."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a, \
            tract.Engine.open(cfg(region_path, 1)) as b:
        await _idle_manager(a)
        mgr = a._manager
        await asyncio.sleep(3 * B.BELL_AFTER_S)
        rate = await _bell_sleeps_per_s(mgr, 1.0)
        idle_s = min(mgr.policy.idle_slice_s, mgr.liveness_timeout_s / 16)
        assert rate <= 1.5 / idle_s, rate
        mute = GlobalLock(b._region, b._handle)
        mute._bell.name = b"\0tract-mgr-nobody-" + os.urandom(8).hex().encode()
        try:
            heard = mgr.statistics().bell_rings
            t0 = time.monotonic()
            await mute.acquire(timeout=5.0)
            waited = time.monotonic() - t0
            mute.release()
            assert mgr.statistics().bell_rings == heard
            assert waited < 1.0, waited              # one idle slice (50 ms), with room
        finally:
            mute.close()


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
