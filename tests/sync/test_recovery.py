"""Crash recovery with kill -9 of real processes: a lock holder, a node inside a chunk claim, the
manager. The survivors work through the kill (lock, recovery, a slot written and read back,
freed: ``procs_lock._work_through_kill``) and every one of their operations completes within
2x the liveness timeout of the kill (issue 36: within 2 s, quiet or beside two busy loops:
``.ci/busy-run``); no wrong word, fsck is clean, nothing is allocated twice."""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tract_async.tools.fsck import run_fsck
from tract_async.region import Region
from tract_async.region.chunks import ChunkTable
from tests.support import procs_lock as P
from tests.support import warmproc
from tests.support.warmproc import forkserver_stopped_after_module  # noqa: F401  (autouse)

SPAWN = warmproc.context()   # the workers fork warm (tests/support/warmproc)

LIVENESS_S = 1.0
BOUND_S = 2 * LIVENESS_S
"""Every survivor operation completes within this of the kill (issue 36's acceptance: 2 s)."""


class Rack:
    """Spawned nodes of one test, with their queue; kills or joins them all at the end."""

    def __init__(self, path: str, backend: str) -> None:
        self.path, self.backend = path, backend
        self.q = SPAWN.Queue()
        self.go, self.stop = SPAWN.Event(), SPAWN.Event()
        self.kill_at = SPAWN.Value("d", 0.0)      # monotonic time of the kill, for survivors
        self.procs: dict[int, Any] = {}
        self.msgs: list[tuple] = []

    def start(self, node_id: int, role: str, *, manager: bool = True) -> None:
        p = SPAWN.Process(target=P.crash_worker,
                          args=(self.path, self.backend, node_id, role, self.q, LIVENESS_S,
                                manager, self.go, self.stop, self.kill_at, BOUND_S))
        p.start()
        self.procs[node_id] = p

    def expect(self, kind: str, node_id: int, timeout: float = 120) -> object:
        for m in self.msgs:
            if m[0] == kind and m[1] == node_id:
                self.msgs.remove(m)
                return m[2]
        deadline = time.monotonic() + timeout
        while True:
            m = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            if m[0] == "error":
                raise AssertionError(f"node {m[1]}: {m[2]}")
            if m[0] == kind and m[1] == node_id:
                return m[2]
            self.msgs.append(m)

    def kill(self, node_id: int) -> float:
        p = self.procs[node_id]
        t = time.monotonic()                # just before: an operation may end right after
        os.kill(p.pid, signal.SIGKILL)
        self.kill_at.value = t
        p.join(10)
        return t

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        for p in self.procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


@pytest.fixture
def rack(region_path: str, request: pytest.FixtureRequest):  # noqa: ANN201
    backend = getattr(request, "param", "hw")
    P.make_region(region_path, backend).close()
    r = Rack(region_path, backend)
    yield r
    r.close()


def _survive(rack: Rack, survivors: list[int], t_kill: float) -> list[dict]:
    rack.go.set()
    out = []
    for n in survivors:
        res = rack.expect("survived", n)
        # the acceptance bound: every operation that was in flight at the kill or started after
        # it completes within BOUND_S of the kill (or of its own start, if later)
        late = [round(end - max(start, t_kill), 3) for start, end in res["ops"] if end > t_kill]
        worst = max(late, default=0.0)
        print(f"survivor {n}: {len(res['ops'])} operations, {len(late)} ended after the kill, "
              f"slowest from the kill {worst:.3f} s")
        assert late, "no survivor operation ended after the kill"
        assert worst < BOUND_S, (n, sorted(late)[-5:], res["recovery"])
        assert res["wrong"] == 0, res["wrong"]
        out.append(res)
    allocs = [a for r in out for a in r["allocs"]]
    assert len(set(allocs)) == len(allocs), "a slot was handed out twice"
    chunks = [c for r in out for c in r["chunks"]]
    assert len(set(chunks)) == len(chunks), "a chunk is owned by two nodes"
    return out


def _chunk_owner(path: str, offset_bytes: int) -> int | None:
    """Node id that owns the chunk holding ``offset_bytes`` (None: free), as memory holds it."""
    with Region.attach(path, backend="hw", readonly=True) as r:
        table = ChunkTable(r)
        return table.owner((offset_bytes - table.geo.chunks_offset) // table.geo.chunk_bytes).owner


def _fsck_clean(path: str) -> None:
    rep = run_fsck(path, liveness_timeout_s=LIVENESS_S)
    assert rep.clean, rep.text()


@pytest.mark.parametrize("rack", ["hw", "sim"], indirect=True)
def test_kill_lock_holder(rack: Rack) -> None:
    rack.start(0, "serve")
    assert rack.expect("serving", 0) == 0
    rack.start(1, "hold", manager=False)
    held_offset = rack.expect("holding", 1)
    assert _chunk_owner(rack.path, held_offset) == 1    # control: the holder's slot is its own
    rack.start(2, "survivor")
    rack.expect("ready", 2)
    t_kill = rack.kill(1)
    (res,) = _survive(rack, [2], t_kill)
    assert res["revocations"] >= 1                      # the dead holder was revoked
    assert any("reclaimed" in d for d in res["recovery"]), res["recovery"]
    # the dead holder's slot is free: its chunk went back to the bitmap (or on to the survivor)
    assert _chunk_owner(rack.path, held_offset) in (None, 2), "the dead holder's chunk leaked"
    _fsck_clean(rack.path)
    rack.close()
    _fsck_clean(rack.path)


def test_kill_inside_chunk_claim(rack: Rack) -> None:
    rack.start(0, "serve")
    rack.expect("serving", 0)
    rack.start(1, "claim", manager=False)
    rack.expect("in-claim", 1)
    before = run_fsck(rack.path, liveness_timeout_s=LIVENESS_S)
    assert any("PENDING" in p for p in before.problems), before.text()
    rack.start(2, "survivor")
    rack.expect("ready", 2)
    t_kill = rack.kill(1)
    (res,) = _survive(rack, [2], t_kill)
    assert any("rolled back claim" in d for d in res["recovery"]), res["recovery"]
    _fsck_clean(rack.path)
    rack.close()
    _fsck_clean(rack.path)


def test_kill_manager(rack: Rack) -> None:
    rack.start(0, "serve")                               # lowest id: the manager
    assert rack.expect("serving", 0) == 0
    rack.start(1, "survivor")
    rack.start(2, "survivor")
    rack.expect("ready", 1)
    rack.expect("ready", 2)
    time.sleep(0.3)                                      # both candidates saw the live manager
    t_kill = rack.kill(0)
    res = _survive(rack, [1, 2], t_kill)
    tokens = sorted(r["token"] for r in res)
    assert tokens[0] >> 32 >= 2, "the survivors' grants come from a new manager term"
    _fsck_clean(rack.path)
    rack.close()
    _fsck_clean(rack.path)


def test_fsck_repair_offline(region_path: str) -> None:
    """A holder and a claimer die with nobody left: fsck finds it, --repair recovers it."""
    P.make_region(region_path, "hw").close()
    rack = Rack(region_path, "hw")
    try:
        rack.start(0, "serve")
        rack.expect("serving", 0)
        rack.start(1, "claim", manager=False)
        rack.expect("in-claim", 1)
        rack.kill(1)
        rack.kill(0)
    finally:
        rack.close()
    time.sleep(LIVENESS_S * 1.1)
    rep = run_fsck(region_path, liveness_timeout_s=LIVENESS_S)
    assert not rep.clean
    text = rep.text()
    assert "PENDING" in text and "manager" in text
    fixed = run_fsck(region_path, repair=True, liveness_timeout_s=LIVENESS_S)
    assert fixed.clean, fixed.text()
    assert any("rolled back claim" in r for r in fixed.repairs), fixed.text()
    _fsck_clean(region_path)
