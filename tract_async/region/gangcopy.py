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

Hand-off: the dispatcher writes a row, then ``write()``s 1 to that worker's eventfd; the worker's
``read()`` returns, and it reads the row with atomic loads (a system call orders both sides'
memory accesses). The worker publishes nothing but its done count and the completion ``write()``
after its copy's own fence (``write_rows`` ends in ``sfence``; ``read_rows`` invalidates before it
reads), so the dispatcher may publish once every job of a copy is counted.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

import tract_kernels as K
from tract_kernels.intrinsics import aload64, astore64, fd_read, fd_write, int64_ptr

from . import index as ix

JOB_WORDS = 16
J_KIND, J_PLAN_ADDR, J_NROWS, J_BASE, J_MEM, J_DONE, J_FAILED = 0, 1, 2, 3, 4, 14, 15
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
def worker_loop(board, worker, wake_fd, done_fd, scratch_addr):
    """Serve jobs posted on ``board[worker]`` until KIND_STOP; returns 0 then, -1 when the wake
    descriptor fails (closed). ``scratch_addr``: 16 private bytes for the eventfd words."""
    row = board.ctypes.data + np.uint64(worker * JOB_WORDS * 8)
    one = np.uint64(scratch_addr) + np.uint64(8)
    astore64(one, np.uint64(1))
    while True:
        fails = 0
        while fd_read(wake_fd, np.uint64(scratch_addr), 8) != 8:
            fails += 1            # EINTR (a signal): read again; a descriptor that keeps
            if fails >= 1000:     # failing is broken (closed before the stop): give up
                return -1
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
