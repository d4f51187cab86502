"""Candidates paused inside the election do not make two managers of one term (model finding
A3, issue 36; ``manager.py``, "Election lapse").

Node 0 manages; nodes 1 (A) and 2 (B) are candidates started with ``TRACT_CRASH_ACTION=stop``,
A at ``elect.ticket`` (its bakery ticket taken) and B at ``elect.decided`` (the manager line
re-read and found missing, its new term not yet written); node 3 only takes the lock. Node 0 is
killed. A, the lowest live candidate, campaigns and stops with its ticket; once A is judged
dead, B campaigns, skips A's ticket and stops just before its write. Now A is continued: before
the fix it did not wait for B (its ticket is the smaller) and wrote term 2; then B, continued,
wrote the term 2 it had decided on: two managers of one term. Asserted: no term is won twice,
both paused candidates left their election without writing (``lapses``), node 3's tokens grow
strictly and it is granted again after both resumed, the manager line names a live node, and
fsck is clean.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

from tract_async import crashpoints as CP
from tract_async.tools.fsck import run_fsck
from tract_async.region import Region
from tract_async.sync import read_manager
from tests.support import procs_elect as E
from tests.support import procs_lock as P

SPAWN = mp.get_context("spawn")
LIVENESS_S = 1.0


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _until(pred, timeout: float) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def _manager(path: str) -> int | None:
    with Region.attach(path, backend="hw", readonly=True) as r:
        return read_manager(r).node_id


def test_paused_candidates_do_not_share_a_term(region_path: str) -> None:
    P.make_region(region_path, "hw").close()
    q = SPAWN.Queue()
    go, stop, arm = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    procs: dict[int, mp.Process] = {}
    msgs: list[tuple] = []

    def expect(kind: str, node: int, timeout: float = 120) -> object:
        for m in msgs:
            if m[:2] == (kind, node):
                msgs.remove(m)
                return m[2]
        end = time.monotonic() + timeout
        while True:
            try:
                m = q.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {kind!r} from node {node} within {timeout} s") from None
            if m[0] == "error":
                raise AssertionError(f"node {m[1]}: {m[2]}")
            if m[:2] == (kind, node):
                return m[2]
            msgs.append(m)

    def spawn(node: int, target, args: tuple, point: str | None = None) -> None:  # noqa: ANN001
        if point is not None:
            os.environ[CP.ENV], os.environ[CP.ENV_ACTION] = point, "stop"
        try:
            p = SPAWN.Process(target=target, args=args)
            p.start()
        finally:
            if point is not None:
                del os.environ[CP.ENV], os.environ[CP.ENV_ACTION]
        procs[node] = p

    try:
        spawn(0, P.crash_worker, (region_path, "hw", 0, "serve", q, LIVENESS_S, True, go, stop))
        assert expect("serving", 0) == 0
        spawn(1, E.candidate, (region_path, 1, LIVENESS_S, q, arm, stop), "elect.ticket")
        spawn(2, E.candidate, (region_path, 2, LIVENESS_S, q, arm, stop), "elect.decided")
        spawn(3, E.lock_user, (region_path, 3, LIVENESS_S, q, stop))
        for n in (1, 2, 3):
            expect("ready", n)
        time.sleep(0.3)                     # the candidates saw the live manager
        arm.set()
        time.sleep(0.1)
        t_kill = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        assert _until(lambda: _stopped(procs[1].pid), 30), "A never stopped with its ticket"
        assert _until(lambda: _stopped(procs[2].pid), 30), "B never stopped before its write"
        assert _manager(region_path) in (None, 0)   # nobody wrote a new term yet
        t_resume = time.monotonic()
        os.kill(procs[1].pid, signal.SIGCONT)
        assert _until(lambda: _manager(region_path) == 1, 30), "A never took over"
        time.sleep(0.3)
        os.kill(procs[2].pid, signal.SIGCONT)
        time.sleep(2 * LIVENESS_S)          # B resumed: its write, if it made one, is in
        mgr = _manager(region_path)
        rep = run_fsck(region_path, liveness_timeout_s=LIVENESS_S)
        stop.set()
        res = {n: expect("done", n) for n in (1, 2, 3)}
    finally:
        stop.set()
        arm.set()
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    print(f"\nkilled at {t_kill:.3f}, A resumed at {t_resume:.3f}\nA: {res[1]}\nB: {res[2]}\n"
          f"manager now node {mgr}; node 3: {len(res[3]['grants'])} grants, the last at "
          f"{max((at for _, at in res[3]['grants']), default=0):.3f}; lock timeouts:\n"
          + "\n".join(res[3]["timeouts"]))
    assert res[1]["stopped"] and res[2]["stopped"]
    terms = res[1]["terms"] + res[2]["terms"]
    assert len(terms) == len(set(terms)), f"two managers of one term: A {res[1]['terms']}, " \
                                          f"B {res[2]['terms']}"
    assert res[1]["lapses"] >= 1 and res[2]["lapses"] >= 1, (res[1], res[2])
    assert mgr in (1, 2)
    toks = [t for t, _ in res[3]["grants"]]
    assert toks == sorted(set(toks)), "a token was granted twice or went back"
    assert any(at > t_resume + 0.3 for _, at in res[3]["grants"]), "no grant after the resumes"
    assert rep.clean, rep.text()
