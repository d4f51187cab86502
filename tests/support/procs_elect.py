"""Worker processes of the paused-election test (``tests/sync/test_election_pause.py``).

Each is a node as ``procs_lock`` makes them (attach, join, a GIL-free heartbeat thread), on the
hardware backend: ``candidate`` runs a LockManager (started with ``TRACT_CRASH_AT`` set to an
``elect.*`` point and ``TRACT_CRASH_ACTION=stop``, it stops itself there once armed),
``lock_user`` only takes the lock, back to back, recording every token.
"""
from __future__ import annotations

import asyncio
import time
import traceback

from tract_async import crashpoints as CP
from tract_async.errors import LockTimeout
from tract_async.sync import GlobalLock, LockManager, PollPolicy, heartbeat_forever
from tests.support.procs_lock import _poll_event, attach


def candidate(path: str, node_id: int, liveness_s: float, q, arm, stop) -> None:  # noqa: ANN001
    """A manager candidate: reports "ready" once a manager is valid, arms its crash point when
    ``arm`` is set, and at ``stop`` reports the terms it won, its election lapses and whether
    it stopped at its point."""
    r = attach(path, "hw", node_id, 0.0, -1)
    try:
        h = r.nodes.join(node_id, timeout_s=liveness_s)

        async def main() -> None:
            mgr = LockManager(r, h, liveness_timeout_s=liveness_s)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(heartbeat_forever(r, h, interval_s=liveness_s / 8)),
                         tg.create_task(mgr.run())]
                q.put(("ready", node_id, None))
                await _poll_event(arm)
                CP.arm()
                await _poll_event(stop, timeout_s=300)
                st = mgr.statistics()
                q.put(("done", node_id, {"terms": list(mgr.terms), "lapses": mgr.lapses,
                                         "stopped": CP.STOPPED, "grants": st.grants,
                                         "step_downs": st.step_downs, "stalls": st.stalls,
                                         "self_fenced": st.self_fenced}))
                for t in tasks:
                    t.cancel()

        asyncio.run(main())
    except BaseException as e:
        q.put(("error", node_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        r.close()


def lock_user(path: str, node_id: int, liveness_s: float, q, stop) -> None:  # noqa: ANN001
    """A node that is no candidate: acquires, re-checks its token, releases, until ``stop``;
    reports every (token, monotonic time of the grant)."""
    r = attach(path, "hw", node_id, 0.0, -1)
    try:
        h = r.nodes.join(node_id, timeout_s=liveness_s)

        async def main() -> None:
            lock = GlobalLock(r, h, policy=PollPolicy(slice_s=0.005))
            grants: list[tuple[int, float]] = []
            timeouts: list[str] = []
            async with asyncio.TaskGroup() as tg:
                beat = tg.create_task(heartbeat_forever(r, h, interval_s=liveness_s / 8))
                q.put(("ready", node_id, None))
                while not stop.is_set():
                    try:
                        tok = await lock.acquire(timeout=5)
                    except LockTimeout:     # no manager for a while: ask again
                        timeouts.append(f"{time.monotonic():.3f} {lock.diagnosis()}")
                        continue
                    try:
                        grants.append((tok, time.monotonic()))
                        lock.check_token()
                    finally:
                        lock.release()
                    await asyncio.sleep(0.005)
                q.put(("done", node_id, {"grants": grants, "timeouts": timeouts}))
                beat.cancel()
            lock.close()

        asyncio.run(main())
    except BaseException as e:
        q.put(("error", node_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        r.close()
