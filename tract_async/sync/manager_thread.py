"""ManagerThread: run a LockManager on a thread and event loop of its own.

Why: the lock manager grants for the whole rack, but the engine's event loop belongs to the
user. A prefill worker runs a blocking model step on its loop; a notebook runs a long cell.
When the manager ran as a task of that loop, each of its scan slices (a GIL-free jitted poll in
a worker thread) needed the loop to schedule the next one, so one busy process froze every
node's puts (measured: node 0 blocking its loop for 8 s, node 1's ``put_kv`` failed with "global
lock not granted within 4.0 s"). On its own thread and loop the manager keeps scanning while
the host loop is blocked; a stall of the manager thread itself (a GIL held for seconds) is
caught by the stall lease in ``manager.py`` and the role fails over.

Ownership. The engine starts the thread and supervises it from a task of its TaskGroup
(``supervise``): an exception of the manager (``NodeEvicted``) surfaces there, and cancelling
the supervisor stops the manager (it resigns its term) and joins the thread before returning.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from .manager import LockManager


class ManagerThread:
    """One LockManager's ``run()`` on a dedicated daemon thread with its own event loop."""

    def __init__(self, manager: LockManager, *, name: str | None = None) -> None:
        self.manager = manager
        self._name = name or f"tract-lock-manager-{manager.node_id}"
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; returns once its loop runs the manager. Idempotent."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._task = loop.create_task(self.manager.run())
            self._ready.set()
            try:
                loop.run_until_complete(self._task)
                self._finish(None)
            except asyncio.CancelledError:
                self._finish(None)
            except BaseException as e:  # noqa: BLE001 - handed to the supervisor
                self._finish(e)
        finally:
            self._ready.set()
            try:
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    def _finish(self, error: BaseException | None) -> None:
        if self._done.set_running_or_notify_cancel():
            if error is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(error)

    def request_stop(self) -> None:
        """Ask the manager to stop (it resigns its term); does not wait. Idempotent."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:    # the loop closed meanwhile: it has stopped already
                pass

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True when it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    async def supervise(self) -> None:
        """Wait for the manager to end and re-raise its error; when cancelled, stop it and
        wait for its thread (at most one scan slice and a resignation) before re-raising."""
        try:
            # shielded: cancelling this wait must not cancel the thread's own future
            await asyncio.shield(asyncio.wrap_future(self._done))
        except asyncio.CancelledError:
            self.request_stop()
            await asyncio.get_running_loop().run_in_executor(None, self.join, 30.0)
            raise

    def stop(self, timeout: float = 30.0) -> bool:
        """Synchronous stop (for code without a loop): request, then join."""
        self.request_stop()
        return self.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __repr__(self) -> str:
        state: Any = "running" if self.alive else ("stopped" if self._thread else "new")
        return f"<ManagerThread node {self.manager.node_id} {state}>"
