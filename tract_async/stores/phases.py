"""PhaseTimes: where a put or get of the region store spends its time, for benchmarks.

Off by default (``RegionStore.phases is None``: one attribute test per phase, a few tens of
nanoseconds). ``Engine.time_phases()`` switches it on and returns the accumulator; the
benchmark reads the seconds per phase of each call (``take()``) instead of wrapping the store's
internals. Phases: ``snapshot`` (index read before a put), ``reserve_incl_lock`` (the whole
reservation: lock wait, allocation, index writes; the lock wait alone is in the store's
``lock_wait_s``), ``copy_call`` (a copy as the caller waits for it: thread hop included),
``copy_kernel`` (the jitted copy itself), ``publish``, ``prepare_read`` (snapshot, waits and
bound checks of a get), ``validate`` (the post-copy revalidation).

Stamps (``stamp``/``stamps``) are instants, not durations: ``publish`` (a put is about to set
its layer bits / READY) and ``woken`` (a doorbell ring finished a wait of this node,
``stores/doorbell.py``). Both are ``perf_counter_ns()`` (CLOCK_MONOTONIC, one clock for every
process of a host), so a benchmark subtracts a producer's ``publish`` from a consumer's
``woken`` to get the wake-up latency across processes.
"""
from __future__ import annotations

import time


class PhaseTimes:
    """Seconds per phase, accumulated until ``take()``."""

    def __init__(self) -> None:
        self._acc: dict[str, float] = {}
        self.stamps: dict[str, int] = {}
        """The latest instant of each stamp, ``perf_counter_ns()``."""

    def stamp(self, name: str) -> None:
        self.stamps[name] = time.perf_counter_ns()

    def add(self, phase: str, t0_ns: int) -> None:
        """Add the time since ``t0_ns`` (``time.perf_counter_ns()``) to ``phase``."""
        self.add_ns(phase, time.perf_counter_ns() - t0_ns)

    def add_ns(self, phase: str, ns: int) -> None:
        self._acc[phase] = self._acc.get(phase, 0.0) + ns / 1e9

    def take(self) -> dict[str, float]:
        """The phases since the last ``take()``, and start over."""
        out, self._acc = self._acc, {}
        return out
