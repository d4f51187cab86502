"""What paused a worker during a request, for the serving timelines: garbage collections
(:class:`GcLog`), a blocked event loop (:class:`LoopLag`) and the CUDA allocator's device calls
(:func:`cuda_alloc_counts`).

A full collection in a worker that holds a model (millions of Python objects) can take tens of
milliseconds, and it runs wherever an allocation crosses the threshold: inside a layer's put, for
example. The region-transfer stall (every request, between the early layers' puts) is one place
this was suspected; the request's events then name each collection longer than ``min_ms``
(``gc<generation>`` at its start, ``gc<generation>_end`` at its end) so that the timeline shows it.
"""
from __future__ import annotations

import asyncio
import collections
import gc
from typing import Any, Callable


class GcLog:
    """Records collections longer than ``min_ms`` (start, end, generation) in a bounded deque."""

    def __init__(self, clock: Callable[[], float], *, min_ms: float = 1.0, keep: int = 256) -> None:
        self._clock = clock
        self._min_s = min_ms / 1e3
        self._start = 0.0
        self.recent: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=keep)
        self._installed = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = self._clock()
        else:
            end = self._clock()
            if end - self._start >= self._min_s:
                self.recent.append((self._start, end, int(info.get("generation", -1))))

    def install(self) -> "GcLog":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def events_between(self, t0: float, t1: float, *, prefix: str = "") -> list[tuple[str, float]]:
        """Timeline events for the collections that started in [t0, t1]; ``prefix`` keeps two
        workers' markers apart in one request's merged events (the decode worker uses "d")."""
        out: list[tuple[str, float]] = []
        for i, (s, e, gen) in enumerate(x for x in list(self.recent) if t0 <= x[0] <= t1):
            out.append((f"{prefix}gc{gen}#{i}", s))
            out.append((f"{prefix}gc{gen}#{i}_end", e))
        return out


class LoopLag:
    """Records where the event loop was blocked, for the serving timelines (``TRACT_PHASES=1``).

    A task sleeps ``tick_ms`` at a time; a wake-up later than ``min_ms`` past its due time means
    the loop ran something else (a synchronous call, a long callback) for that long. The
    request's events then name each such stall (``lag#i`` at the sleep's due time,
    ``lag#i_end`` at the late wake-up), as :class:`GcLog` names collections, so a gap between two
    layers' puts says whether the loop or the computing thread held it. The ticking costs one
    wake-up per ``tick_ms`` while installed: a diagnosis tool, off by default.
    """

    def __init__(self, clock: Callable[[], float], *, tick_ms: float = 2.0, min_ms: float = 5.0,
                 keep: int = 256) -> None:
        self._clock = clock
        self._tick_s = tick_ms / 1e3
        self._min_s = min_ms / 1e3
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=keep)

    async def run(self) -> None:
        """Tick until cancelled (run it as a task of the worker)."""
        while True:
            due = self._clock() + self._tick_s
            await asyncio.sleep(self._tick_s)
            woke = self._clock()
            if woke - due >= self._min_s:
                self.recent.append((due, woke))

    def events_between(self, t0: float, t1: float, *, prefix: str = "") -> list[tuple[str, float]]:
        """Timeline events for the stalls that ended in [t0, t1]."""
        out: list[tuple[str, float]] = []
        for i, (s, e) in enumerate(x for x in list(self.recent) if t0 <= x[1] <= t1):
            out.append((f"{prefix}lag#{i}", s))
            out.append((f"{prefix}lag#{i}_end", e))
        return out


def cuda_alloc_counts() -> dict[str, int]:
    """This process's CUDA caching-allocator counters that a stall could come from: device
    allocations and frees (``cudaMalloc``/``cudaFree``, which may synchronize) and retries after
    an allocation failed (the allocator then frees its cache and synchronizes). Empty without
    CUDA."""
    import torch
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                          "num_sync_all_streams")}
