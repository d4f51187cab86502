"""Waiting for words of the region to change, without blocking the event loop or burning a core.

Memory is the only signal between hosts of a CXL rack (no interrupts cross it), so a wait is a
poll. The policy (measured in the Numba spike on this 2-core machine): a coroutine first re-checks
in the loop for a short spin (``await asyncio.sleep(0)`` a few times, ~10 µs each); then the poll
moves to a worker thread running a ``nogil`` jitted loop that re-reads the words with invalidates,
spins with ``sched_yield`` for ~50 µs, then backs off with ``usleep`` from 20 µs to 500 µs. The
thread returns when the condition holds, at the deadline, or when the coroutine sets its stop
flag (cancellation), so a cancelled wait leaves no thread behind for longer than one back-off.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
from numba import njit

import tract_kernels as K
from tract_kernels.intrinsics import monotonic_ns, sched_yield, usleep

from .region import index as ix

SPIN_NS = 50_000
MAX_SLEEP_US = 500


@njit(cache=True, nogil=True)
def _layers_ready(m, eoff, slots, word, bit, snap):
    ix.layer_bits_batch(m, eoff, slots, snap)
    for i in range(slots.shape[0]):
        st = snap[i, 0]
        if st == ix.READY:
            continue
        if st != ix.RESERVED:
            return -1                        # evicted or never published: stop waiting
        if (np.uint64(snap[i, 1 + word]) & np.uint64(bit)) == 0:
            return 0
    return 1


@njit(cache=True, nogil=True)
def poll_layers(m, eoff, slots, word, bit, deadline_ns, stop, snap):
    """Until every slot has the layer bit (or is READY): 1; an entry vanished: -1; deadline or
    stop flag: 0."""
    t0 = monotonic_ns()
    sleep_us = 20
    while True:
        r = _layers_ready(m, eoff, slots, word, bit, snap)
        if r != 0:
            return r
        now = monotonic_ns()
        if now >= deadline_ns or stop[0] != 0:
            return 0
        if now - t0 < SPIN_NS:
            sched_yield()
        else:
            usleep(sleep_us)
            if sleep_us < MAX_SLEEP_US:
                sleep_us *= 2


@njit(cache=True, nogil=True)
def _all_present(m, eoff, mask, max_probe, keys):
    for i in range(keys.shape[0]):
        if ix._find(m, eoff, mask, max_probe, keys[i, 0], keys[i, 1], keys[i, 2], keys[i, 3]) < 0:
            return False
    return True


@njit(cache=True, nogil=True)
def poll_present(m, eoff, mask, max_probe, keys, deadline_ns, stop):
    """Until every key has a live entry: True; deadline or stop flag: False."""
    t0 = monotonic_ns()
    sleep_us = 20
    while True:
        if _all_present(m, eoff, mask, max_probe, keys):
            return True
        now = monotonic_ns()
        if now >= deadline_ns or stop[0] != 0:
            return False
        if now - t0 < SPIN_NS:
            sched_yield()
        else:
            usleep(sleep_us)
            if sleep_us < MAX_SLEEP_US:
                sleep_us *= 2


def deadline_ns(timeout: float | None) -> int:
    """Monotonic deadline in ns (the clock of ``time.perf_counter_ns``)."""
    return time.perf_counter_ns() + int((timeout if timeout is not None else 0.0) * 1e9)


async def run_poll(fn, *args) -> object:  # noqa: ANN001
    """Run a jitted poll (whose last-but-one argument... see callers) in a thread; a cancelled
    caller sets the stop flag (``args`` carries it) and waits for the thread to notice."""
    stop = next(a for a in args if isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.size == 1)
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        stop[0] = 1
        await asyncio.wait([fut])
        raise
