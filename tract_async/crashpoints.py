"""Named crash points: kill this process (SIGKILL) at one protocol step, for crash tests.

docs/design.md invariant 8 says a node killed at any instruction leaves nothing recovery cannot
repair. The crash tests prove it step by step: a worker process runs with
``TRACT_CRASH_AT=<point>``, calls ``arm()`` once its "before" blocks are published and its
parent has the report, and dies the first time it reaches that point; survivors then recover
(tests/engine/test_crash_points.py).

Off, it costs one global load and a branch per point (``if CP.ARMED: CP.hit(...)`` at the call
site: no call at all), and nothing is read from the environment after import. The points, in
protocol order (``POINTS``), each named after the step it follows:

* ``reserve.locked`` (global lock held, nothing written), ``reserve.allocated`` (payload slots
  marked used, no index entry yet), ``reserve.lockfree`` (the same, on the lock-free path:
  slots taken from this node's free lists, no entry yet), ``reserve.indexed`` (entries
  RESERVED, either path);
* ``put.copied`` (payload bytes in the region, no layer bit yet), ``publish.layer`` (some layers
  published, the block still RESERVED);
* ``evict.tombstoned`` (entries tombstoned, payload slots not yet freed);
* ``abandon.started`` (a failed put evicts its own reservations: in its lane, without the lock;
  with one lane for all nodes, holding it);
* ``claim.found`` (a chunk claim's token check passed and its free run chosen, nothing stored:
  a check and the store it guards, model finding A1), ``claim.journaled``, ``claim.owner``,
  ``claim.bitmap`` (inside a chunk claim's journaled batch), ``claim.done`` (the batch complete, its token not yet re-checked: a holder revoked
  meanwhile must give the chunks back), ``release.journaled`` (a chunk release's batch);
* ``reclaim.hooked`` (a dead node's index entries dropped, its chunks not yet released);
* ``elect.ticket`` (a candidate's bakery ticket taken, before it waits for its rivals),
  ``elect.decided`` (in the election's critical section: the manager line re-read and found
  missing, the new term not yet written -- the manager's check-to-store window);
* ``manager.takeover`` (a new term written, the lock lines not yet taken over),
  ``manager.granted`` (a scan slice that granted or released has returned).

With ``TRACT_CRASH_ACTION=stop`` the process stops itself (SIGSTOP) at the point instead, once:
a node paused, not dead, which its test resumes with SIGCONT after the rack judged it dead
(a revoked-but-live node: its later steps must be fenced without leaking, issue 36).
"""
from __future__ import annotations

import os
import signal

ENV = "TRACT_CRASH_AT"
ENV_ACTION = "TRACT_CRASH_ACTION"

POINTS: tuple[str, ...] = (
    "reserve.locked", "reserve.allocated", "reserve.lockfree", "reserve.indexed", "put.copied",
    "publish.layer", "evict.tombstoned", "abandon.started", "claim.found", "claim.journaled", "claim.owner", "claim.bitmap",
    "claim.done", "release.journaled", "reclaim.hooked", "elect.ticket", "elect.decided", "manager.takeover",
    "manager.granted")

_TARGET: str | None = os.environ.get(ENV) or None
if _TARGET is not None and _TARGET not in POINTS:
    raise ValueError(f"{ENV}={_TARGET!r} names no crash point; known: {', '.join(POINTS)}")

_ACTION = os.environ.get(ENV_ACTION) or "kill"
if _ACTION not in ("kill", "stop"):
    raise ValueError(f"{ENV_ACTION}={_ACTION!r}: expected 'kill' or 'stop'")

STOPPED = False
"""True once this process stopped itself at its point and was resumed (action ``stop``)."""

ARMED = False
"""True once ``arm()`` ran in a process started with ``TRACT_CRASH_AT`` set: call sites test
this before calling ``hit``."""


def arm(target: str | None = None, action: str | None = None) -> None:
    """Start killing at the configured point (a no-op without ``TRACT_CRASH_AT``), or at
    ``target`` where given: a process forked from a warm parent that imported this module
    before the point was chosen (the environment is read only at import) names it here, and
    its ``action`` (``kill`` or ``stop``, as ``TRACT_CRASH_ACTION``) too."""
    global ARMED, _TARGET, _ACTION
    if action is not None:
        if action not in ("kill", "stop"):
            raise ValueError(f"action {action!r}: expected 'kill' or 'stop'")
        _ACTION = action
    if target is not None:
        if target not in POINTS:
            raise ValueError(f"{target!r} names no crash point; known: {', '.join(POINTS)}")
        _TARGET = target
    ARMED = _TARGET is not None


def hit(point: str) -> None:
    """Die now (SIGKILL, no cleanup, as a crash) if ``point`` is the configured one; with
    action ``stop``, stop the whole process there once (SIGSTOP: every thread, the heartbeat's
    too) and go on when it is continued."""
    global ARMED, STOPPED
    if ARMED and point == _TARGET:
        if _ACTION == "stop":
            ARMED = False
            os.kill(os.getpid(), signal.SIGSTOP)
            STOPPED = True
            return
        os.kill(os.getpid(), signal.SIGKILL)
