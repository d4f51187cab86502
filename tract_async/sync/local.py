"""The node-local tier of the global lock: at most one contender per node.

Two layers, taken in this order and released in reverse:

1. An ``asyncio.Lock`` per ``GlobalLock`` object: coroutines of one process queue here, in FIFO
   order, without touching the region.
2. An OFD record lock (``F_OFD_SETLK``) on byte ``LOCAL_LOCK_BASE + lock_index * 4096 + node_id``
   of the region file, through a file description opened by this ``GlobalLock``. It keeps the
   node's *processes* apart (and two ``GlobalLock`` objects of one process: OFD locks conflict
   between open file descriptions, not between processes). The kernel drops it when its holder
   dies, even by SIGKILL, so a crashed holder never wedges the node; the next process of the
   node then finds the node's request line in W or L and withdraws it before requesting
   (``slots.post_request``), so the global tier moves on too.

Only the holder of both layers writes the node's request line: that is the hand-off that keeps
the line single-writer across the node's processes. The OFD lock is polled (non-blocking
attempts with a short growing sleep) rather than waited for with ``F_OFD_SETLKW``, because a
blocked ``fcntl`` in a thread cannot be cancelled and every wait here has a deadline.
"""
from __future__ import annotations

import asyncio
import os
import time

from ..errors import LockTimeout
from ..region.ofd import ofd_lock, ofd_unlock

LOCAL_LOCK_BASE = (1 << 40) + (1 << 24)
"""Byte offset (past any region's end, above the node-id bytes of nodes.py) of the lock bytes."""


class NodeLocalLock:
    """asyncio lock + OFD byte lock for one (lock index, node). Not thread-safe (one loop)."""

    def __init__(self, path: str, lock_index: int, node_id: int) -> None:
        self._byte = LOCAL_LOCK_BASE + lock_index * 4096 + node_id
        self._fd = os.open(path, os.O_RDWR)
        self._alock = asyncio.Lock()
        self._ofd_held = False

    @property
    def locked(self) -> bool:
        return self._alock.locked()

    async def _acquire_alock(self, deadline: float) -> None:
        """The asyncio layer, with a deadline, never leaking it.

        Not ``asyncio.wait_for(lock.acquire(), t)``: on Python 3.11 a timeout or a cancellation
        that races with the acquire completing can lose the result, leaving the lock taken by
        nobody (every later acquire then times out: the intermittent hang seen in Engine.close).
        Here the acquire runs as a task; on timeout or cancellation it is cancelled and awaited,
        and released if it got the lock after all."""
        if not self._alock.locked():
            await self._alock.acquire()          # free: completes without suspending
            return
        task = asyncio.ensure_future(self._alock.acquire())
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:
            await self._abandon(task)
            raise
        if not done:
            await self._abandon(task)
            raise LockTimeout("timed out waiting for this process's other users of the lock")
        task.result()

    async def _abandon(self, task: "asyncio.Future[bool]") -> None:
        task.cancel()
        try:
            await asyncio.wait({task})
        finally:
            if task.done() and not task.cancelled() and task.exception() is None:
                self._alock.release()            # it won the race: give it back

    async def acquire(self, deadline: float) -> None:
        """Take both layers before ``deadline`` (time.monotonic()). Raises LockTimeout."""
        await self._acquire_alock(deadline)
        try:
            pause = 0.0002
            while not ofd_lock(self._fd, self._byte):
                if time.monotonic() >= deadline:
                    raise LockTimeout("timed out waiting for another process of this node to "
                                      "release the node-local lock")
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.005)
            self._ofd_held = True
        except BaseException:
            self._alock.release()
            raise

    def acquire_nowait(self) -> bool:
        """Take both layers if both are free right now."""
        if self._alock.locked():
            return False
        if not ofd_lock(self._fd, self._byte):
            return False
        # asyncio.Lock.acquire() on a free lock completes without suspending
        coro = self._alock.acquire()
        try:
            coro.send(None)
        except StopIteration:
            pass
        else:  # pragma: no cover - cannot happen on a free lock
            coro.close()
            ofd_unlock(self._fd, self._byte)
            return False
        self._ofd_held = True
        return True

    def release(self) -> None:
        """Release both layers (OFD first, then the asyncio lock)."""
        if self._ofd_held:
            self._ofd_held = False
            ofd_unlock(self._fd, self._byte)
        if self._alock.locked():
            self._alock.release()

    def close(self) -> None:
        """Drop the file description (and with it any OFD lock). Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._ofd_held = False
