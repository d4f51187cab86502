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
* ``claim.journaled``, ``claim.owner``, ``claim.bitmap`` (inside a chunk claim's journaled
  batch), ``release.journaled`` (a chunk release's batch);
* ``reclaim.hooked`` (a dead node's index entries dropped, its chunks not yet released);
* ``manager.takeover`` (a new term written, the lock lines not yet taken over),
  ``manager.granted`` (a scan slice that granted or released has returned).
"""
from __future__ import annotations

import os
import signal

ENV = "TRACT_CRASH_AT"

POINTS: tuple[str, ...] = (
    "reserve.locked", "reserve.allocated", "reserve.lockfree", "reserve.indexed", "put.copied",
    "publish.layer", "evict.tombstoned", "abandon.started", "claim.journaled", "claim.owner", "claim.bitmap",
    "release.journaled", "reclaim.hooked", "manager.takeover", "manager.granted")

_TARGET: str | None = os.environ.get(ENV) or None
if _TARGET is not None and _TARGET not in POINTS:
    raise ValueError(f"{ENV}={_TARGET!r} names no crash point; known: {', '.join(POINTS)}")

ARMED = False
"""True once ``arm()`` ran in a process started with ``TRACT_CRASH_AT`` set: call sites test
this before calling ``hit``."""


def arm() -> None:
    """Start killing at the configured point (a no-op without ``TRACT_CRASH_AT``)."""
    global ARMED
    ARMED = _TARGET is not None


def hit(point: str) -> None:
    """Die now (SIGKILL, no cleanup, as a crash) if ``point`` is the configured one."""
    if ARMED and point == _TARGET:
        os.kill(os.getpid(), signal.SIGKILL)
