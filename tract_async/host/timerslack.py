"""Tighter sleeps for the threads that poll shared memory (Linux timer slack).

A poll that backs off with ``usleep(20)`` really sleeps ~70 µs on Linux: the kernel may delay a
timer by the thread's *timer slack* (50 µs by default) to batch wake-ups. For the few threads
whose sleeps sit on a latency path (the lock manager's scan, lock waiters, the StreamFuture
poller, layer waits) that slack is most of the wait. ``tighten()`` sets the calling thread's
slack to 1 µs with ``prctl(PR_SET_TIMERSLACK)``: no spinning, the same number of wake-ups, each
on time. It is per thread, idempotent, cheap (one syscall the first time per thread), and a
no-op where prctl is missing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

PR_SET_TIMERSLACK = 29
SLACK_NS = 1000

_local = threading.local()
_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def tighten() -> bool:
    """Set this thread's timer slack to ``SLACK_NS``; True when it is (now or already) set."""
    if getattr(_local, "done", False):
        return True
    if _prctl is None:
        return False
    ok = _prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(SLACK_NS), 0, 0, 0) == 0
    _local.done = ok
    return ok


def call_tight(fn, *args):  # noqa: ANN001, ANN201
    """``fn(*args)`` on this thread after ``tighten()`` (for ``run_in_executor``)."""
    tighten()
    return fn(*args)
