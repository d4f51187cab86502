"""Attaching while the creator is still initializing: wait for a live creator, refuse a dead one.

The creator is a real second process whose ``initialize`` step blocks until the test lets it
go, so "still initializing" lasts exactly as long as the test says; no test sleeps to make a
window. To see that an attach really waited, the test watches ``being_created`` answer True
(the attacher found the creator alive) before it lets the creator finish.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

import tract_async as tract
from tract_async import errors as E
from tract_async.region import Region
from tract_async.region import layout as L
from tract_async.region import region as region_mod
from tests.support import procs_region as P
from tests.support.engine_util import cfg

SPAWN = mp.get_context("spawn")


def _start_creator(path: str, engine_sections: bool = False):  # noqa: ANN202
    q, go = SPAWN.Queue(), SPAWN.Event()
    proc = SPAWN.Process(target=P.create_held_in_init, args=(path, engine_sections, q, go))
    proc.start()
    what, pid, _ = q.get(timeout=120)
    assert what == "initializing" and pid == proc.pid
    return proc, q, go


def _stop(proc, go) -> None:  # noqa: ANN001
    go.set()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _watch_being_created(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set once some attach has found the creator alive (and so is waiting)."""
    seen = threading.Event()
    real = region_mod.being_created

    def spy(path: str) -> bool:
        alive = real(path)
        if alive:
            seen.set()
        return alive
    monkeypatch.setattr(region_mod, "being_created", spy)
    return seen


def test_attach_waits_for_a_live_creator(region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    proc, q, go = _start_creator(region_path)
    try:
        with pytest.raises(E.RegionInitializing, match="still initializing") as exc:
            Region.attach(region_path, wait_init_s=0.0)
        assert "creator died" not in str(exc.value)
        seen = _watch_being_created(monkeypatch)
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(Region.attach(region_path, wait_init_s=120)))
        t.start()
        assert seen.wait(60), "the attach never found the creator alive"
        assert t.is_alive() and not got          # it is waiting, not failing
        go.set()
        t.join(120)
        what, uuid, _ = q.get(timeout=60)
        assert what == "ready" and len(got) == 1
        r = got[0]
        assert isinstance(r, Region) and str(r.uuid) == uuid
        assert r.header["init_state"] == L.INIT_READY
        r.close()
    finally:
        _stop(proc, go)


def test_a_dead_creator_is_reported_at_once(region_path: str) -> None:
    proc, _, go = _start_creator(region_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    t0 = time.monotonic()
    with pytest.raises(E.RegionCorrupt, match="never fully initialized") as exc:
        Region.attach(region_path, wait_init_s=120)
    assert time.monotonic() - t0 < 60, "it waited for a creator that is dead"
    assert "creator died" in str(exc.value)


async def test_engine_waits_for_a_live_creator(region_path: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    proc, q, go = _start_creator(region_path, engine_sections=True)
    try:
        with pytest.raises(E.RegionInitializing, match="EngineConfig.attach_timeout_s"):
            await tract.Engine.open(cfg(region_path, 1, attach_timeout_s=0.2))
        seen = _watch_being_created(monkeypatch)
        opening = asyncio.ensure_future(tract.Engine.open(cfg(region_path, 1)).__aenter__())
        while not seen.is_set():                   # the loop keeps running while it waits
            await asyncio.sleep(0.01)
            assert not opening.done(), opening
        go.set()
        eng = await asyncio.wait_for(opening, 120)
        try:
            keys = eng.block_keys(range(32))
            assert eng.lookup(keys) == 0
        finally:
            await eng.close()
    finally:
        _stop(proc, go)
