"""CopyGang: persistent copy threads that run GIL-free, polled awake between the copies of a burst.

The copy back-end (``stores/cpucopy.py``) cuts a large copy into row groups. On a thread pool
each group costs two GIL hand-offs, serialised behind each other (``region/gangcopy.py`` has the
figures); a gang worker takes none. The gang is bound to the event loop of its first copy:

* ``run`` posts one group per worker on the job board (``region/gangcopy.py``: its layout
  table), bumps the worker's ``seq`` and ``eventfd_write``s it awake;
* with ``own`` (the loop's share), the loop's thread copies that group itself meanwhile (the
  kernel releases the GIL), then polls the workers' done counts for up to ``LOOP_WAIT_NS``
  (``gangcopy.wait_done``): a copy whose workers finish in that time returns without the loop
  ever sleeping;
* otherwise -- or when the poll runs out -- it awaits a future that the loop's reader of the
  gang's done eventfd resolves once every posted worker's done count reached its target.

Why the loop copies too, and polls. On the 16-core H200 host an event loop asleep in its
selector takes 50-150 µs to wake, and so does a worker asleep in ``read()`` (their idle cores
drop into deep C-states). A layer-streamed handoff made four such round trips per layer on each
side; the loop now does a share of the copy instead of sleeping, and the workers poll for the
next job for ``WORKER_SPIN_NS`` after each one (``region/gangcopy.py``).

Completion is counted on the board (each worker's done count against the target ``run`` set),
not by the eventfd's counts: a copy that completed by polling leaves its eventfd writes to be
drained later, and those must not count toward the next copy.

One copy at a time: ``run`` is for an idle gang (``idle``); the copier sends a copy that finds it
busy to its thread pool instead, so nothing queues behind a long copy. A cancelled caller still
waits for every worker of its copy (docs/design.md invariant 7: a worker cannot be interrupted, and
the caller must not free or reuse what it still copies), then re-raises.

Idle cost: none between bursts. A worker polls for ``WORKER_SPIN_NS`` after a job (yielding its
core between looks), then sleeps in ``read()`` until it is posted a job.
``close`` posts KIND_STOP to every worker, joins them and closes the descriptors (idempotent).
"""
from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable

import numpy as np

import tract_kernels as K

from ..region import gangcopy as G
from ..sync.settle import settled

WORKER_SPIN_NS = int(float(os.environ.get("TRACT_GANG_SPIN_US", "500")) * 1000)
"""How long a worker polls for its next job after one (``$TRACT_GANG_SPIN_US``, default 500;
0: sleep at once). The layers of one streamed transfer come a few hundred µs apart."""

LOOP_WAIT_NS = 500_000
"""How long the loop's thread, after its own share, polls the workers' done counts before it
awaits the eventfd instead (a worker that was asleep needs 50-150 µs to start)."""


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
        self._workers = np.zeros(0, dtype=np.int64)   # the posted workers of the copy in flight
        self._targets = np.zeros(0, dtype=np.int64)   # ... and the done counts that end it
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
                if G.worker_loop(self.board, i, self._wake[i], self._done_fd, scratch,
                                 WORKER_SPIN_NS) == 0:
                    return
                # its wake descriptor failed: no more jobs for this gang (copies take the pool)
                self._broken = True
                self._errors[i] = OSError(f"copy gang worker {i}: its eventfd kept failing")
                self.board[i, G.J_DONE] += 1
                os.eventfd_write(self._done_fd, 1)
                return
            except BaseException as e:      # noqa: BLE001 - reported to the copy that posted it
                self._errors[i] = e
                self.board[i, G.J_DONE] += 1
                os.eventfd_write(self._done_fd, 1)

    def _all_done(self) -> bool:
        """Every posted worker's done count reached its target."""
        return bool((self.board[self._workers, G.J_DONE] >= self._targets).all())

    def _finish(self) -> BaseException | None:
        """The copy in flight is done: clear it; its error, if any."""
        self._fut = None
        self._keep = []
        errs = [e for e in self._errors if e is not None]
        failed = int(self.board[:, G.J_FAILED].sum())
        self._errors = [None] * self.workers
        self.board[:, G.J_FAILED] = 0
        if errs:
            return errs[0]
        if failed:
            return AssertionError(
                f"copy gang: {failed} group(s) refused (a row outside the region, or not "
                f"the hardware backend): the dispatcher's checks should have caught it")
        return None

    def _on_done(self) -> None:
        try:
            os.eventfd_read(self._done_fd)     # a wake-up only: completion is counted on the board
        except BlockingIOError:
            pass
        fut = self._fut
        if fut is None or not self._all_done():
            return
        err = self._finish()
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(None)

    async def run(self, kind: int, mem: K.Mem, groups: list[np.ndarray], base: int, *,
                  own: tuple[Any, np.ndarray] | None = None) -> None:
        """Copy ``groups`` (plan row arrays, at most ``workers``) on the workers, one each, and
        return when every one is done (also when cancelled: then re-raise). ``kind``:
        ``gangcopy.KIND_PUT`` (private -> region), ``KIND_GET`` / ``KIND_GET_NT`` (region ->
        private, with cached / non-temporal stores). ``own``: ``(kernel, plan)``, a further
        group that the loop's thread copies itself (``kernel(mem, plan, base)``) while the
        workers copy theirs; then it polls for them (module doc). Raises IndexError (nothing
        posted) for a row outside the region; the loop's own kernel's error after every worker
        is done; AssertionError when called busy, closed, or from another loop."""
        size = int(mem[K.MEM_SIZE_BYTES])
        for g in (*groups, *(() if own is None else (own[1],))):
            if not G.rows_in_region(size, g):
                raise IndexError("region byte range out of bounds")
        await self._dispatch(mem, [(kind, g, base, None) for g in groups],
                             None if own is None else (lambda: own[0](mem, own[1], base)))

    async def run_jobs(self, mem: K.Mem, jobs: list[tuple[int, np.ndarray, int, np.ndarray]],
                       own: Callable[[], Any] | None = None) -> Any:
        """Post ``jobs`` -- ``(kind, plan, base, args)`` of the kinds that take argument words
        (``gangcopy.KIND_GET_CHECKED``; each job's result lands in its ``args``) -- one per
        worker, run ``own()`` on the loop's thread meanwhile, and return its
        result once every worker is done (as ``run``: also when cancelled, then re-raise).
        Raises IndexError (nothing posted) for a plan row outside the region."""
        size = int(mem[K.MEM_SIZE_BYTES])
        for _, plan, _, _ in jobs:
            if not G.rows_in_region(size, plan):
                raise IndexError("region byte range out of bounds")
        return await self._dispatch(mem, jobs, own)

    async def _dispatch(self, mem: K.Mem,
                        jobs: list[tuple[int, np.ndarray, int, np.ndarray | None]],
                        own: Callable[[], Any] | None) -> Any:
        loop = asyncio.get_running_loop()
        if not self.idle or not self.serves(loop) or len(jobs) > self.workers:
            raise AssertionError("copy gang: a run needs an idle gang of this loop with a "
                                 "worker per job")
        if not self._threads:
            self._start(loop)
        fut: asyncio.Future[None] = loop.create_future()
        self._fut = fut
        plans = [np.ascontiguousarray(j[1], dtype=np.int64) for j in jobs]
        self._keep = plans + [j[3] for j in jobs if j[3] is not None]
        b = self.board
        self._workers = np.arange(len(jobs), dtype=np.int64)
        self._targets = b[:len(jobs), G.J_DONE] + 1
        for i, ((kind, _, base, args), plan) in enumerate(zip(jobs, plans)):
            b[i, G.J_KIND] = kind
            b[i, G.J_PLAN_ADDR] = plan.ctypes.data
            b[i, G.J_NROWS] = plan.shape[0]
            b[i, G.J_BASE] = base
            b[i, G.J_MEM:G.J_MEM + 10] = mem
            b[i, G.J_ARGS] = 0 if args is None else args.ctypes.data
            b[i, G.J_SEQ] += 1
            os.eventfd_write(self._wake[i], 1)
        own_err: BaseException | None = None
        got: Any = None
        if own is not None:
            try:
                got = own()
            except BaseException as e:     # noqa: BLE001 - raised once the workers are done
                own_err = e
            if G.wait_done(b, self._workers, self._targets, LOOP_WAIT_NS):
                err = self._finish()
                if own_err is not None:
                    raise own_err
                if err is not None:
                    raise err
                return got
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await settled(fut)               # the workers cannot be stopped mid-copy
            if not fut.cancelled():          # the cancellation wins over its outcome
                fut.exception()
            raise
        if own_err is not None:
            raise own_err
        return got

    def close(self) -> None:
        """Stop the workers (after the copy in flight, if any) and close the descriptors.
        Idempotent; call it on the gang's loop's thread (or with no loop started)."""
        if self._closed:
            return
        self._closed = True
        for i, t in enumerate(self._threads):
            self.board[i, G.J_KIND] = G.KIND_STOP
            self.board[i, G.J_SEQ] += 1
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
