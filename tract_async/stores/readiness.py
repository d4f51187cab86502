"""Waiting until a read's blocks are there: the snapshot checks and the waits of a read.

A read that may wait (``get_kv(..., timeout=...)``, every layer-streamed handoff) asks whether
each of its keys is present and has the layer (READY for a whole read), and if not waits:
on the doorbell when every live node shares this host (``stores/doorbell.py``: a producer
rings, the waiter looks once per ring, with safety timers), else by the GIL-free thread poll of
``stores/waits.py``; a same-host wait first spins on the loop's own thread for
``EngineConfig.wait_spin_us``. Every wait runs against one absolute deadline and raises
``TransferTimeout`` saying what was missing.

Why a module of its own (issue 37): these were ten methods of the block lifecycle
(``stores/blocks.py``), which only needs "wait until these keys are readable". The waits use
the lifecycle's index, doorbell, geometry, memory and stats through :class:`WaitHost`, a seam
typed here, so this module imports nothing of ``blocks.py`` (one-way tie).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import numpy as np

from ..errors import BlockNotFound, LayerNotReady, TransferTimeout
from ..region import index as ix
from ..region.index import SNAP_COLS, SNAP_LAYERS, SNAP_SLOT, SNAP_STATE
from . import doorbell as db
from . import waits

SMALL_READ = 8
"""Transfers of at most this many blocks take the Python-int paths (a get checks its snapshot
after ``tolist``, a put splits its snapshot and builds its allocation rows in plain loops):
each numpy operation costs ~1 µs whatever its size, more than the loop for a few blocks."""

LOOP_SLICE_NS = 20_000
"""The longest the loop is held by one slice of the on-loop spin (other tasks run between
slices)."""

_TIMER = object()
"""What a wait's safety timer resolves its future with (``ReadyWaits._on_doorbell``)."""


def _wake_timer(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(_TIMER)


class WaitHost(Protocol):
    """What the waits use of their node's block lifecycle (``stores/blocks.py``)."""
    index: Any
    doorbell: Any
    stats: Any
    region: Any
    geo: Any
    cfg: Any
    spin_ns: int

    @property
    def mem(self) -> Any: ...


def rows_available(rows: list[list[int]], layer: int | None) -> bool:
    """``satisfied`` on snapshot rows as Python lists (a few blocks)."""
    if layer is None:
        return all(r[SNAP_SLOT] >= 0 and r[SNAP_STATE] == ix.READY for r in rows)
    col, bit = SNAP_LAYERS + layer // 64, layer % 64
    return all(r[SNAP_SLOT] >= 0 and (r[SNAP_STATE] == ix.READY or (r[col] >> bit) & 1)
               for r in rows)


def satisfied(snap: np.ndarray, layer: int | None) -> bool:
    """Every row of ``snap`` present and with ``layer`` (READY for None)."""
    if snap.shape[0] <= SMALL_READ:             # Python ints: no numpy round
        return rows_available(snap.tolist(), layer)
    if (snap[:, SNAP_SLOT] < 0).any():
        return False
    if layer is None:
        return bool((snap[:, SNAP_STATE] == ix.READY).all())
    word, bit = divmod(layer, 64)
    return bool(((snap[:, SNAP_STATE] == ix.READY)
                 | ((snap[:, SNAP_LAYERS + word] >> bit) & 1 == 1)).all())


def first_unsatisfied(snap: np.ndarray, layer: int | None) -> int:
    """The first row of ``snap`` that is absent or lacks ``layer`` (READY for None); 0 when
    every row is satisfied."""
    ok = snap[:, SNAP_SLOT] >= 0
    if layer is None:
        ok &= snap[:, SNAP_STATE] == ix.READY
    else:
        word, bit = divmod(layer, 64)
        ok &= (snap[:, SNAP_STATE] == ix.READY) | ((snap[:, SNAP_LAYERS + word] >> bit) & 1 == 1)
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else 0


def check_available(keys: list[bytes], snap: np.ndarray, layer: int | None, stats: Any) -> None:
    """Raise BlockNotFound (counted in ``stats.misses``) or LayerNotReady unless every block
    of ``snap`` is available (``satisfied``)."""
    # the common cases without a Python loop: every block READY, or (a layer read of blocks
    # still being produced, as in every layer-streamed handoff) every block present with
    # the layer in -- the loop below cost ~0.4 ms per 1024-block layer read on the VM
    if satisfied(snap, layer):
        return
    for i in range(len(keys)):
        if snap[i, SNAP_SLOT] < 0:
            stats.misses += 1
            raise BlockNotFound(f"block {i} of {len(keys)} ({keys[i][:8].hex()}…) is not in "
                                f"the region (never stored, or evicted); lookup() says how "
                                f"many leading blocks are resident")
        st = snap[i, SNAP_STATE]
        if st == ix.READY:
            continue
        if layer is None:
            raise LayerNotReady(f"block {i} ({keys[i][:8].hex()}…) is still being produced; "
                                f"pass timeout= to wait for it, or get it layer by layer")
        word, bit = divmod(layer, 64)
        if not (int(snap[i, SNAP_LAYERS + word]) >> bit) & 1:
            raise LayerNotReady(f"layer {layer} of block {i} ({keys[i][:8].hex()}…) has not "
                                f"landed yet; pass timeout= to wait for it")


def timed_out(snap: np.ndarray, layer: int | None, timeout: float) -> None:
    """Raise the TransferTimeout that says what ``snap`` still lacked."""
    absent = int((snap[:, SNAP_SLOT] < 0).sum())
    if absent:
        raise TransferTimeout(f"{absent} of {len(snap)} blocks did not appear within "
                              f"{timeout} s")
    raise TransferTimeout(f"{'layer ' + str(layer) if layer is not None else 'blocks'} "
                          f"not produced within {timeout} s")


class ReadyWaits:
    """The waits of one node's reads (module docstring). Stateless beside its host."""

    def __init__(self, host: WaitHost) -> None:
        self._host = host

    def first_look(self, words: np.ndarray, layer: int | None) -> np.ndarray:
        """A waiting read's first snapshot: of the last key alone while it is not ready, when
        there are ``waits.SENTINEL_MIN_KEYS`` or more (the other rows say "absent", which
        ``satisfied`` reads as not ready: the wait then looks at all of them); else of all.
        A layer-streamed get asks before its producer publishes, and a full look at 2048 keys
        costs ~0.3-0.5 ms on the 2-core VM (``waits.ready_state`` says why the last key)."""
        n = words.shape[0]
        if n >= waits.SENTINEL_MIN_KEYS:
            last = self._host.index.snapshot(words[n - 1:])
            if not satisfied(last, layer):
                snap = np.full((n, SNAP_COLS), -1, dtype=np.int64)
                snap[n - 1] = last[0]
                return snap
        return self._host.index.snapshot(words)

    async def wait(self, words: np.ndarray, snap: np.ndarray, layer: int | None,
                          timeout: float) -> np.ndarray:
        """Wait until every key is present and has the layer / is READY: on the doorbell when
        every live node shares this host, else by the thread poll (``stores/doorbell.py``).
        Returns the last snapshot (a block seen and then gone: the caller's checks raise)."""
        self._host.stats.layer_waits += 1
        if satisfied(snap, layer):
            return snap
        bell = self._host.doorbell
        if bell.receiving and bell.one_host(self._host.cfg.liveness_timeout_s):
            return await self._on_doorbell(words, snap, layer, timeout)
        return await self._polling(words, snap, layer, timeout)

    async def _on_doorbell(self, words: np.ndarray, snap: np.ndarray, layer: int | None,
                                timeout: float) -> np.ndarray:
        deadline = time.monotonic() + timeout
        seen = snap[:, SNAP_SLOT] >= 0
        last = [snap]
        probe = [first_unsatisfied(snap, layer)]

        def check(full: bool = False) -> np.ndarray | None:
            # A ring says that something was published on this host, not what: with several
            # requests in flight, most rings are for other keys. One key that was not yet
            # satisfied at the last full look decides whether a full look can succeed (every
            # key must be): it costs one lookup where the full look costs one per key (a
            # decode worker's queued 512-block reads, each woken by every layer of every
            # prefill, took the GIL from its model thread). A vanished block is seen at the
            # probe, at the next full look, or at a timer's look (always full).
            i = probe[0]
            if not full and len(words) > 1:
                one = self._host.index.snapshot(words[i:i + 1])
                if one[0, 0] >= 0 or not seen[i]:
                    if not satisfied(one, layer):
                        self._host.stats.doorbell_probe_skips += 1
                        return None
            s = self._host.index.snapshot(words)
            last[0] = s
            present = s[:, SNAP_SLOT] >= 0
            if (seen & ~present).any() or satisfied(s, layer):
                return s                   # done, or a block vanished (the caller raises)
            seen[:] |= present
            probe[0] = first_unsatisfied(s, layer)
            return None

        spun = await self._spin_on_loop(words, layer)
        if spun is not None:
            self._host.stats.spin_wakes += 1
            return spun
        bell = self._host.doorbell
        loop = asyncio.get_running_loop()
        w = bell.add(check)
        try:
            got = check(full=True)         # after registering: the race (doorbell.py)
            interval = db.SAFETY_FIRST_S
            while got is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out(last[0], layer, timeout)
                fut = w.fut
                timer = loop.call_later(min(interval, left), _wake_timer, fut)
                try:
                    got = await fut
                finally:
                    timer.cancel()
                if got is _TIMER:
                    bell.rearm(w)
                    got = check(full=True)
                    interval = min(interval * 2, db.SAFETY_MAX_S)
                else:
                    self._host.stats.doorbell_wakes += 1
            return got
        finally:
            bell.remove(w)

    async def _spin_on_loop(self, words: np.ndarray, layer: int | None) -> np.ndarray | None:
        """The first ``spin_ns`` of a same-host wait (``EngineConfig.wait_spin_us``, from the
        host by default: ``waits.auto_wait_spin_us``): the jitted poll of ``waits.py`` on the
        loop's own thread, GIL released, in slices of ``LOOP_SLICE_NS`` with the loop's other
        tasks run between them. Returns the snapshot once satisfied (or a block vanished), None
        when the spin ran out. Why (measured on the 16-core H200 host, ``bench/wakeup.py`` and
        ``bench/wakecost.py``): a process asleep in its selector takes 20-150 us to wake on that
        host however it is woken (a bare datagram wake-up: 152 us p50), because its idle vCPU
        has halted, and then runs 2-4x slower for a while; most waits end within a put's time
        of their start (the consumer asks just before its producer writes), so a spin sees the
        block within a poll's time and leaves the sleep (and its wake-up) to waits that outlast
        it. The poll yields the CPU (``sched_yield``) between looks, so on 2 cores it gives way
        to the producer."""
        if self._host.spin_ns <= 0:
            return None
        g = self._host.geo
        word, bit = (0, 0) if layer is None else divmod(layer, 64)
        out = np.zeros((words.shape[0], SNAP_COLS), dtype=np.int64)
        stop = np.zeros(1, dtype=np.uint8)
        end = time.perf_counter_ns() + self._host.spin_ns
        while True:
            now = time.perf_counter_ns()
            if now >= end:
                return None
            r = waits.poll_ready(self._host.mem, g.entries_offset, self._host.index.mask, g.max_probe,
                                 g.lanes, words,
                                 word, np.uint64(1 << bit), layer is None,
                                 min(end, now + LOOP_SLICE_NS), stop, out)
            if r != 0:
                return out
            await asyncio.sleep(0)

    async def _polling(self, words: np.ndarray, snap: np.ndarray, layer: int | None,
                            timeout: float) -> np.ndarray:
        """The cross-host wait: a brief in-loop spin, then the thread poll of ``waits.py``."""
        deadline = waits.deadline_ns(timeout)
        g = self._host.geo
        for _ in range(3):  # brief in-loop spin: the common case is "already there"
            if satisfied(snap, layer):
                return snap
            await asyncio.sleep(0)
            snap = self._host.index.snapshot(words)
        stop = np.zeros(1, dtype=np.uint8)
        word, bit = (0, 0) if layer is None else divmod(layer, 64)
        out = np.zeros_like(snap)
        r = await waits.run_poll(waits.poll_ready, waits.ThreadMem(self._host.region), g.entries_offset,
                                 self._host.index.mask,
                                 g.max_probe, g.lanes, words, word, np.uint64(1 << bit),
                                 layer is None, deadline, stop, out)
        if r == 0:
            timed_out(self._host.index.snapshot(words), layer, timeout)   # a full look
        return out          # r == -1: a block vanished; the caller's checks raise BlockNotFound


__all__ = ["LOOP_SLICE_NS", "ReadyWaits", "SMALL_READ", "WaitHost", "check_available",
           "first_unsatisfied", "rows_available", "satisfied", "timed_out"]
