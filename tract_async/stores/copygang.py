"""CopyGang: persistent copy threads that run GIL-free and are woken by eventfds.

The copy back-end (``stores/cpucopy.py``) cuts a large copy into row groups. On a thread pool
each group costs two GIL hand-offs, serialised behind each other (``region/gangcopy.py`` has the
figures); a gang worker takes none. The gang is bound to the event loop of its first copy:

* ``run`` posts one group per worker on the job board (``region/gangcopy.py``: its layout
  table), ``eventfd_write``s each worker awake, and awaits a future;
* each worker copies, fences, and counts the job on the gang's done eventfd, which the loop
  watches (``add_reader``); the loop's callback reads the count and resolves the future once
  every group of the copy is in.

One copy at a time: ``run`` is for an idle gang (``idle``); the copier sends a copy that finds it
busy to its thread pool instead, so nothing queues behind a long copy. A cancelled caller still
waits for every worker of its copy (DESIGN.md invariant 7: a worker cannot be interrupted, and
the caller must not free or reuse what it still copies), then re-raises.

Idle cost: none. A worker sleeps in ``read()`` until it is posted a job; there is no polling.
``close`` posts KIND_STOP to every worker, joins them and closes the descriptors (idempotent).
"""
from __future__ import annotations

import asyncio
import os
import threading

import numpy as np

import tract_kernels as K

from ..region import gangcopy as G


class CopyGang:
    """``workers`` GIL-free copy threads for one region's ``Mem`` (hardware backend only)."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"CopyGang needs at least one worker, got {workers}")
        self.workers = workers
        self.board = np.zeros((workers, G.JOB_WORDS), dtype=np.int64)
        self._scratch = np.zeros((workers, 2), dtype=np.uint64)
        self._wake = [os.eventfd(0) for _ in range(workers)]
        self._done_fd = os.eventfd(0, os.EFD_NONBLOCK)
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException | None] = [None] * workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fut: asyncio.Future[None] | None = None
        self._pending = 0
        self._keep: list[np.ndarray] = []     # the posted plans, alive until their jobs are done
        self._closed = False
        self._broken = False

    @property
    def idle(self) -> bool:
        """No copy in flight, not closed, no worker lost: ``run`` may be called."""
        return self._fut is None and not self._closed and not self._broken

    def serves(self, loop: asyncio.AbstractEventLoop) -> bool:
        """This gang can run copies awaited on ``loop`` (the loop of its first copy)."""
        return self._loop is None or self._loop is loop

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._done_fd, self._on_done)
        for i in range(self.workers):
            t = threading.Thread(target=self._serve, args=(i,), name=f"tract-gang-{i}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, i: int) -> None:
        scratch = int(self._scratch.ctypes.data) + 16 * i
        while True:
            try:
                if G.worker_loop(self.board, i, self._wake[i], self._done_fd, scratch) == 0:
                    return
                # its wake descriptor failed: no more jobs for this gang (copies take the pool)
                self._broken = True
                self._errors[i] = OSError(f"copy gang worker {i}: its eventfd kept failing")
                if self._fut is not None:
                    os.eventfd_write(self._done_fd, 1)
                return
            except BaseException as e:      # noqa: BLE001 - reported to the copy that posted it
                self._errors[i] = e
                os.eventfd_write(self._done_fd, 1)

    def _on_done(self) -> None:
        try:
            n = os.eventfd_read(self._done_fd)
        except BlockingIOError:
            return
        self._pending -= n
        fut = self._fut
        if self._pending <= 0 and fut is not None:
            self._fut = None
            self._keep = []
            errs = [e for e in self._errors if e is not None]
            failed = int(self.board[:, G.J_FAILED].sum())
            self._errors = [None] * self.workers
            self.board[:, G.J_FAILED] = 0
            if fut.done():
                return
            if errs:
                fut.set_exception(errs[0])
            elif failed:
                fut.set_exception(AssertionError(
                    f"copy gang: {failed} group(s) refused (a row outside the region, or not "
                    f"the hardware backend): the dispatcher's checks should have caught it"))
            else:
                fut.set_result(None)

    async def run(self, kind: int, mem: K.Mem, groups: list[np.ndarray], base: int) -> None:
        """Copy ``groups`` (plan row arrays, at most ``workers``) on the workers, one each, and
        return when every one is done (also when cancelled: then re-raise). ``kind``:
        ``gangcopy.KIND_PUT`` (private -> region), ``KIND_GET`` / ``KIND_GET_NT`` (region ->
        private, with cached / non-temporal stores). Raises IndexError (nothing posted) for a
        row outside the region; AssertionError when called busy, closed, or from another loop."""
        loop = asyncio.get_running_loop()
        if not self.idle or not self.serves(loop) or len(groups) > self.workers:
            raise AssertionError("copy gang: run() needs an idle gang of this loop with a "
                                 "worker per group")
        size = int(mem[K.MEM_SIZE_BYTES])
        for g in groups:
            if not G.rows_in_region(size, g):
                raise IndexError("region byte range out of bounds")
        if not self._threads:
            self._start(loop)
        fut: asyncio.Future[None] = loop.create_future()
        self._fut, self._pending = fut, len(groups)
        self._keep = [np.ascontiguousarray(g, dtype=np.int64) for g in groups]
        b = self.board
        for i, g in enumerate(self._keep):
            b[i, G.J_KIND] = kind
            b[i, G.J_PLAN_ADDR] = g.ctypes.data
            b[i, G.J_NROWS] = g.shape[0]
            b[i, G.J_BASE] = base
            b[i, G.J_MEM:G.J_MEM + 10] = mem
            os.eventfd_write(self._wake[i], 1)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():            # the workers cannot be stopped mid-copy
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    pass
                except BaseException:        # noqa: BLE001 - the cancellation wins
                    break
            raise

    def close(self) -> None:
        """Stop the workers (after the copy in flight, if any) and close the descriptors.
        Idempotent; call it on the gang's loop's thread (or with no loop started)."""
        if self._closed:
            return
        self._closed = True
        for i, t in enumerate(self._threads):
            self.board[i, G.J_KIND] = G.KIND_STOP
            os.eventfd_write(self._wake[i], 1)
        for t in self._threads:
            t.join()
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._done_fd)
            except (RuntimeError, ValueError):
                pass
        for fd in (*self._wake, self._done_fd):
            os.close(fd)
