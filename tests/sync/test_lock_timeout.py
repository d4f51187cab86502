"""A global-lock acquire that times out holds nothing afterwards, the node-local tier included.

It used to keep the node-local tier (the asyncio lock and the OFD byte) after withdrawing its
request: every later acquire in the process then queued behind a holder that did not exist.
On a cold Numba cache that is what hung the first ``Engine.close`` of examples/quickstart.py
forever: the maintenance task's acquire timed out while the manager compiled on the loop, and
close's allocator trim queued behind the leak.
"""
from __future__ import annotations

import pytest

from tract_async import errors as E
from tract_async.sync import GlobalLock
from tests.support import procs_lock as P


async def test_a_timed_out_acquire_releases_the_node_local_tier(region_path: str) -> None:
    r = P.make_region(region_path, "hw")
    h = r.nodes.join(0, timeout_s=1.0)
    lock, other = GlobalLock(r, h), GlobalLock(r, h)
    try:
        with pytest.raises(E.LockTimeout, match="not granted"):   # no manager runs: no grant
            await lock.acquire(timeout=0.05)
        assert not lock.held and not lock._local.locked
        assert other._local.acquire_nowait(), "the OFD byte of the node is still taken"
        other._local.release()
        with pytest.raises(E.LockTimeout, match="not granted"):   # not "other users of the lock"
            await lock.acquire(timeout=0.05)
    finally:
        lock.close()
        other.close()
        r.nodes.leave(h)
        r.close()


async def test_a_timeout_says_what_the_lock_lines_hold(region_path: str) -> None:
    """The error names the manager line, the holder, this node's sequences and the node table:
    the stress's 9 s timeout was explained by exactly these (a live holder, a valid manager)."""
    r = P.make_region(region_path, "hw")
    h = r.nodes.join(2, timeout_s=1.0)
    lock = GlobalLock(r, h)
    try:
        with pytest.raises(E.LockTimeout) as info:
            await lock.acquire(timeout=0.05)
        msg = str(info.value)
        assert "no manager (term 0)" in msg and "holder None" in msg, msg
        # the withdrawn request: req_seq == rel_seq, never granted
        assert "node 2 req_seq 1 " in msg and "rel_seq 1 grant_seq 0" in msg, msg
        assert "nodes 2:live(" in msg, msg
    finally:
        lock.close()
        r.nodes.leave(h)
        r.close()
