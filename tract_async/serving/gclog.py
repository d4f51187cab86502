"""Which garbage collections ran during a request, for the serving timelines.

A full collection in a worker that holds a model (millions of Python objects) can take tens of
milliseconds, and it runs wherever an allocation crosses the threshold: inside a layer's put, for
example. The region-transfer stall (every request, between the early layers' puts) is one place
this was suspected; the request's events then name each collection longer than ``min_ms``
(``gc<generation>`` at its start, ``gc<generation>_end`` at its end) so that the timeline shows it.
"""
from __future__ import annotations

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
