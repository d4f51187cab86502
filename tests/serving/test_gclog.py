"""GcLog: the collections a request's timeline shows."""
from __future__ import annotations

import gc
import time

from tract_async.serving.gclog import GcLog


def test_gclog_names_the_collections_of_a_window() -> None:
    log = GcLog(time.monotonic, min_ms=0.0).install()
    try:
        before = time.monotonic()
        keep = [[i] for i in range(200_000)]          # something for the collector to walk
        gc.collect()
        after = time.monotonic()
        ev = log.events_between(before, after)
        full = [(n, t) for n, t in ev if n.startswith("gc2#") and not n.endswith("_end")]
        assert full, ev
        name, start = full[-1]
        end = dict(ev)[name + "_end"]
        assert before <= start <= end <= after
        assert log.events_between(after + 1, after + 2) == []
        del keep
    finally:
        log.uninstall()
    assert log._callback not in gc.callbacks
