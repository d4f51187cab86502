"""The approximate LRU's read stamps: reads are recorded here and stamped into the index later.

A read does not write the region's index on its way (that would put a store to shared memory,
and on CXL a flush, on every read's path). It records ``(slot, version)`` here instead, and the
lifecycle stamps the recorded reads into the entries' access times at its next maintenance or
locked reservation (``index.touch_batch``, which needs no lock: a stamp whose version no longer
matches is skipped). Small reads go into a dict (one row per slot); a large read keeps its
arrays as they are (a dict update cost ~30 µs per 256 blocks on the VM, paid again by every
layer of a layer-streamed get), and past ``TOUCH_ROWS_MAX`` rows they are stamped at once.

Ties: owned and called by the block lifecycle (``stores/blocks.py``); calls the index kernel.
"""
from __future__ import annotations

import time

import numpy as np

from ..region import Region
from ..region import index as ix
from .readiness import SMALL_READ

TOUCH_ROWS_MAX = 1 << 16
"""Reads of large transfers kept for the next flush before they are stamped at once."""


class TouchLog:
    """Reads recorded since the last flush, for one node over one region's index."""

    def __init__(self, region: Region, entries_offset: int) -> None:
        self.region = region
        self.entries_offset = entries_offset
        self._small: dict[int, int] = {}                       # slot -> version
        self._rows: list[tuple[np.ndarray, np.ndarray]] = []   # large reads, as they came
        self._count = 0                                        # rows in _rows

    def record(self, slots: np.ndarray, versions: np.ndarray) -> None:
        """Record reads of ``slots`` at ``versions`` (a slot read twice is stamped twice at the
        flush, which is harmless)."""
        if len(slots) <= SMALL_READ:
            self._small.update(zip(slots.tolist(), versions.tolist()))
            return
        self._rows.append((slots.astype(np.int64), versions.astype(np.int64)))
        self._count += len(slots)
        if self._count > TOUCH_ROWS_MAX:
            self.flush()

    def flush(self) -> None:
        """Stamp the reads recorded since the last flush into the index (no lock needed)."""
        if not self._small and not self._rows:
            return
        slots = np.fromiter(self._small.keys(), dtype=np.int64)
        versions = np.fromiter(self._small.values(), dtype=np.int64)
        if self._rows:
            slots = np.concatenate([slots, *(r[0] for r in self._rows)])[::-1]
            versions = np.concatenate([versions, *(r[1] for r in self._rows)])[::-1]
            # each slot once (a layer-streamed get reads each block once per layer), with the
            # version of its latest read (the arrays are reversed: latest first)
            slots, first = np.unique(slots, return_index=True)
            versions = np.ascontiguousarray(versions[first])
            self._rows = []
            self._count = 0
        self._small.clear()
        ix.touch_batch(self.region.mem, self.entries_offset, slots, versions, time.time_ns())
