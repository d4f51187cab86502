"""A poll's spin phase that yields the core only while yielding is cheap.

The lock's waiters and its manager poll in two phases: first they spin, calling
``sched_yield`` between polls (on an idle two-core machine a yield returns within a
microsecond and the poll sees a grant at once), then they sleep with growing ``usleep``.
Beside a task that never yields back (a busy loop, a model step on the same core), a yield
is the wrong wait: Linux's fair scheduler (EEVDF since 6.6) puts the yielder behind the busy
task for the rest of its time slice, so each poll of the spin costs a slice, while a sleeper
is woken ahead of the busy task when its timer fires. Measured on the 2-core VM beside two
busy loops (``.ci/busy-run``), ``bench/lock.py --backend sim``: four contending processes got
the lock at p50 8.5 ms with the yielding spin, 1.4-1.6 ms with this; idle, the yielding spin
is the right wait, and this leaves it on (``bench/results/vm-20261206-s44``).

So a yield is timed: one that kept the core away for more than ``YIELD_SLOW_NS`` may have met
such a task; a second within ``SLOW_PAIR_NS`` says it did, and for the next ``YIELD_OFF_NS``
every poll of this process sleeps instead of yielding (``polite_yield`` returns False: the
caller sleeps). Then yields are tried again, so the idle machine's fast path comes back once
the load has gone. The state is two words per process (``STATE``), shared by its waiter
threads and its manager thread: a race on them only decides whether one more yield is tried.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .intrinsics import monotonic_ns, sched_yield

YIELD_SLOW_NS = 500_000
"""A yield away from the core for longer than this may have met a task that does not yield
back (a yield between pollers returns in a few microseconds; a busy task keeps its slice, a
millisecond or more; 0.1 ms also caught other processes' Python running a while, and idle
contention got slower)."""

SLOW_PAIR_NS = 5_000_000
"""Two slow yields this close together turn yields off: one alone may be a runnable thread of
another process that ran a while (its event loop, a heartbeat), not a busy task. (Not two in a
row: beside one busy loop on the same CPU, slow and fast yields alternate.)"""

YIELD_OFF_NS = 20_000_000
"""How long a process polls by sleeping after a slow yield before it tries yielding again."""

STATE = np.zeros(2, dtype=np.int64)
"""This process's yield state: [0] is the ``monotonic_ns`` until which polls sleep, [1] when
the last slow yield ended (0: none since yields came back)."""


@njit(cache=True, nogil=True)
def polite_yield(state: np.ndarray, now: int) -> bool:
    """``sched_yield`` unless recent yields were slow (module docstring): True when it yielded,
    False when the caller should sleep instead. ``now``: the caller's ``monotonic_ns``."""
    if now < state[0]:
        return False
    sched_yield()
    after = monotonic_ns()
    if after - now > YIELD_SLOW_NS:
        if after - state[1] < SLOW_PAIR_NS:
            state[0] = after + YIELD_OFF_NS
            state[1] = 0
        else:
            state[1] = after
    return True
