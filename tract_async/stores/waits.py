"""Waiting for words of the region to change, without blocking the event loop or burning a core.

Since the doorbells (``doorbell.py``), this is the path of a wait that no doorbell can reach: a
node on another host is live, or this node has no doorbell socket. Same-host waits sleep in
the event loop's selector and are woken by the producer's datagram, with a timer as the
safety net; they use no thread and no spin.

Memory is the only signal between hosts of a CXL rack (no interrupts cross it), so a wait is a
poll. The policy (measured in the Numba spike on this 2-core machine): a coroutine first re-checks
in the loop for a short spin (``await asyncio.sleep(0)`` a few times, ~10 µs each); then the poll
moves to a worker thread running a ``nogil`` jitted loop that re-reads the words with invalidates,
spins with ``sched_yield`` for ~300 µs, then backs off with ``usleep`` from 10 µs, doubling to
100 µs during the first 2 ms and to 500 µs after (``_backoff``), with a 1 µs timer slack
(``timerslack``) so that each sleep lasts what it says. Why 300 µs: a consumer usually starts
waiting just before its producer's put, and a small put takes ~100-250 µs on the 2-core VM (lock
grant included); a 50 µs spin left the thread in a 40-100 µs sleep (+50 µs slack) when the block
landed. Measured on the 64 KiB handoff (3 runs of 250 each): time from put return to get return
p50 ~120-180 µs -> ~60-90 µs; a 150 µs spin gave ~60-110 µs. The spin yields the core to any
runnable thread and is bounded per wait, so it costs at most 0.3 ms of CPU per get that waits.
A get waits with one poll from "absent" to "READY / has the layer" (``poll_ready``): one thread
hop per wait. The
thread returns when the condition holds, at the deadline, or when the coroutine sets its stop
flag (cancellation), so a cancelled wait leaves no thread behind for longer than one back-off.
"""
from __future__ import annotations

import asyncio
import os
import time

import numpy as np
from numba import njit

from tract_kernels.intrinsics import monotonic_ns, sched_yield, usleep

from ..region import index as ix
from ..region.index import SNAP_LAYERS, SNAP_SLOT, SNAP_STATE
from ..host.timerslack import call_tight

SPIN_NS = 300_000
FAST_NS = 2_000_000
MAX_SLEEP_US = 500

WAIT_SPIN_ENV = "TRACT_WAIT_SPIN_US"
MANY_CORES = 8
"""From this many cores a same-host wait spins ``LONG_SPIN_US`` on its loop's thread, below it
``SHORT_SPIN_US`` (``auto_wait_spin_us``)."""
SHORT_SPIN_US = 300
LONG_SPIN_US = 2000


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a cpuset or ``taskset`` counts),
    else ``os.cpu_count()``. What the host-sized defaults (``auto_wait_spin_us``,
    ``cpucopy.auto_copy_threads``) count: a process confined to 2 CPUs of a 16-core host must
    size itself as on a 2-core host."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def auto_wait_spin_us(cpus: int | None = None) -> int:
    """How long a same-host wait spins before it sleeps on the doorbell, for
    ``EngineConfig.wait_spin_us=None``: ``$TRACT_WAIT_SPIN_US`` when set, else ``SHORT_SPIN_US``
    with fewer than ``MANY_CORES`` CPUs to run on (``cpus``, default this process's affinity
    mask) and ``LONG_SPIN_US`` from there.

    Why two figures. On 2 cores a spinner takes the core its producer needs: 300 µs (about a
    small put) catches the waits that end at once and leaves the rest to the doorbell. On the
    16-core H200 host (a Firecracker guest whose idle vCPUs halt) a sleeping waiter pays twice
    when it is woken: a blocking wake-up across processes took 20-43 µs p50 against 3-6 µs for
    a spinning reader, and the code that runs next ran 2-4x slower than back to back (a 64 KiB
    get 26 -> 54-73 µs; ``bench/wakecost.py``). A consumer that asks 1 ms before its producer
    writes (the handoff benchmark's ``64K-wait1ms``) then spent 118-227 µs from the put's end
    to its get's; spinning 2 ms, 37.6 µs. A spin costs at most that much of one core per wait
    that outlasts it, and none while nothing waits."""
    env = os.environ.get(WAIT_SPIN_ENV)
    if env:
        return max(0, int(float(env)))
    if cpus is None:
        cpus = usable_cpus()
    return LONG_SPIN_US if cpus >= MANY_CORES else SHORT_SPIN_US


@njit(cache=True, nogil=True)
def _all_present(m, eoff, mask, max_probe, lanes, keys):
    for i in range(keys.shape[0]):
        if ix.find_entry(m, eoff, mask, max_probe, lanes, keys[i, 0], keys[i, 1], keys[i, 2], keys[i, 3]) < 0:
            return False
    return True


@njit(cache=True, nogil=True)
def poll_present(m, eoff, mask, max_probe, lanes, keys, deadline_ns, stop):
    """Until every key has a live entry: True; deadline or stop flag: False."""
    t0 = monotonic_ns()
    sleep_us = 10
    while True:
        if _all_present(m, eoff, mask, max_probe, lanes, keys):
            return True
        now = monotonic_ns()
        if now >= deadline_ns or stop[0] != 0:
            return False
        sleep_us = _backoff(t0, now, sleep_us)


@njit(cache=True, nogil=True)
def _backoff(t0, now, sleep_us):
    """One wait step of the poll policy; returns the next sleep. Spin with ``sched_yield`` for
    SPIN_NS (about one small put: module docstring), then ``usleep`` from 10 µs doubling to
    100 µs during the first FAST_NS (a producer usually publishes within a millisecond of a
    consumer starting to wait), then to MAX_SLEEP_US."""
    if now - t0 < SPIN_NS:
        sched_yield()
        return sleep_us
    usleep(sleep_us)
    cap = 100 if now - t0 < FAST_NS else MAX_SLEEP_US
    return min(sleep_us * 2, cap)


SENTINEL_MIN_KEYS = 16
"""Waits for at least this many keys look at their last key first (``ready_state``)."""


@njit(cache=True, nogil=True)
def _row_ready(snap, i, word, bit, whole, seen):
    """``ready_state`` for row ``i`` of a snapshot: 1 satisfied, 0 not yet, -1 vanished."""
    if snap[i, SNAP_SLOT] < 0:
        return -1 if seen[i] else 0
    seen[i] = 1
    st = snap[i, SNAP_STATE]
    if st == ix.READY:
        return 1
    if whole or st != ix.RESERVED:
        return 0
    return 1 if (np.uint64(snap[i, SNAP_LAYERS + word]) & np.uint64(bit)) != 0 else 0


@njit(cache=True, nogil=True)
def ready_state(m, eoff, mask, max_probe, lanes, keys, word, bit, whole, snap, seen):
    """1 when every key's entry is READY (``whole``) or has the layer bit (else); 0 when not
    yet (absent, or still being produced); -1 when an entry seen earlier in this wait (``seen``)
    has vanished (its producer gave up or it was evicted: waiting longer is pointless).

    The last key first. A producer publishes a batch's layer in key order (one kernel call,
    ``publish_and_look``, slot by slot), so while the last key lacks what the wait needs, the
    others' rows are not worth reading: with ``SENTINEL_MIN_KEYS`` keys or more, a look
    snapshots the last key alone and returns 0 when it is not ready -- the rest of ``snap``
    then keeps what an earlier look left there. Only a look that finds it ready (or gone)
    snapshots all of them and decides. A full look at 2048 keys costs ~0.3-0.5 ms on the 2-core VM
    (every key's home lines invalidated and read); a spinning wait of a layer-streamed get
    repeated it back to back, so it saw a layer land up to one look late and its
    invalidations competed with the producer's copy for memory. A wait for keys of several
    producers still ends correctly (the full look decides), only later than it could."""
    n = keys.shape[0]
    if n >= SENTINEL_MIN_KEYS:
        ix.snapshot_batch(m, eoff, mask, max_probe, lanes, keys[n - 1:], snap[n - 1:])
        if _row_ready(snap, n - 1, word, bit, whole, seen) == 0:
            return 0        # (vanished: the full look below fills ``snap`` for the report)
    ix.snapshot_batch(m, eoff, mask, max_probe, lanes, keys, snap)
    for i in range(n):
        r = _row_ready(snap, i, word, bit, whole, seen)
        if r != 1:
            return r
    return 1


@njit(cache=True, nogil=True)
def poll_ready(m, eoff, mask, max_probe, lanes, keys, word, bit, whole, deadline_ns, stop, snap):
    """One poll from "maybe absent" to "READY / has the layer" (the single-poll wait: one thread
    hop instead of one for presence and another for the layer). 1 when satisfied, -1 when an
    entry vanished during the wait, 0 at the deadline or when the stop flag is set. ``snap``
    (n, 8) holds the last snapshot."""
    t0 = monotonic_ns()
    sleep_us = 10
    seen = np.zeros(keys.shape[0], dtype=np.uint8)
    while True:
        r = ready_state(m, eoff, mask, max_probe, lanes, keys, word, bit, whole, snap, seen)
        if r != 0:
            return r
        now = monotonic_ns()
        if now >= deadline_ns or stop[0] != 0:
            return 0
        sleep_us = _backoff(t0, now, sleep_us)


def deadline_ns(timeout: float | None) -> int:
    """Monotonic deadline in ns (the clock of ``time.perf_counter_ns``)."""
    return time.perf_counter_ns() + int((timeout if timeout is not None else 0.0) * 1e9)


class ThreadMem:
    """Stands in an argument list for ``region.mem`` *as the worker thread sees it*.

    With the sim backend each thread has its own private cache (``Region.mem``), and that
    model's arrays are not thread-safe: a ``Mem`` taken on the event loop's thread and handed
    to a worker thread would be used by both at once (the loop keeps reading the node table,
    the index...), corrupting the model. ``resolve_thread_mem`` resolves it on the worker
    thread. The hardware backend has one stateless view, so nothing changes there."""

    __slots__ = ("region",)

    def __init__(self, region) -> None:  # noqa: ANN001
        self.region = region


def resolve_thread_mem(fn, *args):  # noqa: ANN001, ANN202
    """``fn(*args)`` with every ``ThreadMem`` replaced by the calling thread's view: the
    function to hand to ``run_in_executor``."""
    return fn(*[a.region.mem if isinstance(a, ThreadMem) else a for a in args])


async def run_poll(fn, *args) -> object:  # noqa: ANN001
    """Run a jitted poll (whose last-but-one argument... see callers) in a thread; a cancelled
    caller sets the stop flag (``args`` carries it) and waits for the thread to notice. Pass
    the region's view as ``ThreadMem(region)``, never as a ``Mem`` taken on this thread."""
    stop = next(a for a in args if isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.size == 1)
    # a tight timer slack: the back-off's usleep(10..100) sleeps that long, not ~50 µs more
    # (timerslack.py); on the handoff path that slack is most of the wake-up latency
    fut = asyncio.get_running_loop().run_in_executor(None, call_tight, resolve_thread_mem, fn,
                                                     *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        stop[0] = 1
        await asyncio.wait([fut])
        raise
