"""The jitted side of the copy gang (``stores/copygang.py``): worker loops that never take the GIL.

Why. A copy cut into row groups on a ``ThreadPoolExecutor`` pays two GIL hand-offs per thread
(the worker's Python around the kernel call, then the future's completion), one after another:
on the 16-core H200 host a 2 MiB put cut in two took 514 µs against 110 µs on one thread, and
every further thread added ~50 µs (``bench/copypath.py``, 2026-12-04). A gang worker is a thread
that enters ``worker_loop`` once and stays in nopython code for its whole life: it sleeps in
``read()`` on its own eventfd, copies the group posted on its line of the job board, fences, and
counts the job done on a shared eventfd that the event loop watches. Nothing of it needs the GIL
until it stops.

The job board (private memory of one process, int64[workers, JOB_WORDS]; one 128-byte row per
worker, so that two workers' rows share no cache line):

| word | name      | writer                 | meaning                                        |
|------|-----------|------------------------|------------------------------------------------|
| 0    | kind      | dispatcher             | KIND_PUT, KIND_GET, KIND_GET_NT or KIND_STOP   |
| 1    | plan_addr | dispatcher             | address of the group's plan rows (int64[n, 3]) |
| 2    | nrows     | dispatcher             | rows of that plan                              |
| 3    | base      | dispatcher             | private address the plan's second column adds to |
| 4-13 | mem       | dispatcher             | the region's ``Mem`` (``kernels/memfields.py``) |
| 14   | done      | worker                 | jobs this worker finished (a count)            |
| 15   | failed    | worker                 | jobs it refused (a row out of the region)      |
| 16   | seq       | dispatcher             | jobs posted to this worker (a count)           |
| 17-31| (unused)  |                        | pads the row to 256 bytes                      |

Hand-off: the dispatcher writes a row, bumps ``seq``, then ``write()``s 1 to that worker's
eventfd. A worker that finished a job within the last ``spin_ns`` is still polling ``seq`` (with
``sched_yield`` between looks) and takes the job from there; one asleep in ``read()`` is woken
by the eventfd. Either way it reads the row with atomic loads after it saw ``seq`` move (x86
keeps the dispatcher's stores in order, and a system call orders both sides' accesses). A wake
whose job was already taken by polling leaves a count in the eventfd: the next ``read()``
returns at once, finds ``seq`` unchanged, and reads again (one spurious system call).

Why the poll. On the 16-core H200 host a thread asleep in ``read()`` takes 50-150 µs to wake
(its idle core is in a deep C-state; ``bench/wakeup.py``). A layer-streamed transfer posts a copy
per layer, a few hundred microseconds apart: polling for ``spin_ns`` after each job keeps the
workers awake between the layers of one transfer and asleep (no CPU at all) between transfers.

The worker publishes nothing but its done count and the completion ``write()`` after its copy's
own fence (``write_rows`` ends in ``sfence``; ``read_rows`` invalidates before it reads), so the
dispatcher may publish once every job of a copy is counted: by the eventfd the loop watches, or
by polling the done counts itself (``wait_done``).
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

import tract_kernels as K
from tract_kernels.intrinsics import (aload64, astore64, fd_read, fd_write, int64_ptr,
                                      monotonic_ns, sched_yield)

from . import index as ix

JOB_WORDS = 32
J_KIND, J_PLAN_ADDR, J_NROWS, J_BASE, J_MEM, J_DONE, J_FAILED, J_SEQ = 0, 1, 2, 3, 4, 14, 15, 16
KIND_PUT, KIND_GET, KIND_GET_NT, KIND_STOP = 1, 2, 3, 9


@njit(cache=True, nogil=True)
def rows_in_region(size_bytes, plan):
    """True when every plan row lies inside a region of ``size_bytes`` (what the copy kernels
    would raise IndexError for, checked before a job is posted: a worker cannot raise)."""
    for i in range(plan.shape[0]):
        if plan[i, 0] < 0 or plan[i, 2] < 0 or plan[i, 0] + plan[i, 2] > size_bytes:
            return False
    return True


@njit(cache=True, nogil=True)
def _seq_moved(seq_addr, last, spin_ns):
    """Poll a worker's ``seq`` word for up to ``spin_ns``: True once it differs from ``last``."""
    if spin_ns <= 0:
        return False
    end = monotonic_ns() + spin_ns
    while True:
        if np.int64(aload64(seq_addr)) != last:
            return True
        if monotonic_ns() >= end:
            return False
        sched_yield()


@njit(cache=True, nogil=True)
def worker_loop(board, worker, wake_fd, done_fd, scratch_addr, spin_ns):
    """Serve jobs posted on ``board[worker]`` until KIND_STOP; returns 0 then, -1 when the wake
    descriptor fails (closed). ``scratch_addr``: 16 private bytes for the eventfd words.
    ``spin_ns``: how long to poll ``seq`` after a job before sleeping in ``read()``."""
    row = board.ctypes.data + np.uint64(worker * JOB_WORDS * 8)
    seq_addr = row + np.uint64(J_SEQ * 8)
    one = np.uint64(scratch_addr) + np.uint64(8)
    astore64(one, np.uint64(1))
    last = np.int64(0)        # the board starts zeroed: a job posted before this thread
    #                           ran is still new to it
    after_job = False         # poll first only right after a job (not after a spurious wake)
    while True:
        if not (after_job and _seq_moved(seq_addr, last, spin_ns)):
            fails = 0
            while fd_read(wake_fd, np.uint64(scratch_addr), 8) != 8:
                fails += 1            # EINTR (a signal): read again; a descriptor that keeps
                if fails >= 1000:     # failing is broken (closed before the stop): give up
                    return -1
            if np.int64(aload64(seq_addr)) == last:
                after_job = False     # the wake of a job already taken by polling
                continue
        last = np.int64(aload64(seq_addr))
        after_job = True
        kind = np.int64(aload64(row + np.uint64(J_KIND * 8)))
        if kind == KIND_STOP:
            return 0
        nrows = np.int64(aload64(row + np.uint64(J_NROWS * 8)))
        plan = carray(int64_ptr(aload64(row + np.uint64(J_PLAN_ADDR * 8))), (nrows, 3))
        base = aload64(row + np.uint64(J_BASE * 8))
        w = row + np.uint64(J_MEM * 8)
        m = (np.int64(aload64(w)), np.int64(aload64(w + np.uint64(8))),
             np.int64(aload64(w + np.uint64(16))), np.int64(aload64(w + np.uint64(24))),
             np.int64(aload64(w + np.uint64(32))), np.int64(aload64(w + np.uint64(40))),
             np.int64(aload64(w + np.uint64(48))), np.int64(aload64(w + np.uint64(56))),
             np.int64(aload64(w + np.uint64(64))), np.int64(aload64(w + np.uint64(72))))
        if not rows_in_region(m[K.MEM_SIZE_BYTES], plan) or m[K.MEM_BACKEND] != K.BACKEND_HW:
            failed = row + np.uint64(J_FAILED * 8)
            astore64(failed, aload64(failed) + np.uint64(1))
        elif kind == KIND_PUT:
            K.write_rows(m, plan, base, ix.S_IX_PAYLOAD_WRITE)
        else:
            K.read_rows(m, plan, base, ix.S_IX_PAYLOAD_READ, kind == KIND_GET_NT)
        done = row + np.uint64(J_DONE * 8)
        astore64(done, aload64(done) + np.uint64(1))
        fd_write(done_fd, one, 8)


@njit(cache=True, nogil=True)
def wait_done(board, workers, targets, spin_ns):
    """The dispatcher's side: poll until ``board[workers[j], done] >= targets[j]`` for every j,
    for at most ``spin_ns`` (``sched_yield`` between looks). True when all are done."""
    base = board.ctypes.data
    end = monotonic_ns() + spin_ns
    while True:
        alldone = True
        for j in range(workers.shape[0]):
            a = base + np.uint64((workers[j] * JOB_WORDS + J_DONE) * 8)
            if np.int64(aload64(a)) < targets[j]:
                alldone = False
                break
        if alldone:
            return True
        if monotonic_ns() >= end:
            return False
        sched_yield()
