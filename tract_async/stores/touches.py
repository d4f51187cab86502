"""The approximate LRU's read stamps: reads are recorded here and stamped into the index later.

A read does not write the region's index on its way (that would put a store to shared memory,
and on CXL a flush, on every read's path). It records ``(slot, version)`` here instead, and the
lifecycle stamps the recorded reads into the entries' access times at its next maintenance or
locked reservation (``index.touch_batch``, which needs no lock: a stamp whose version no longer
matches is skipped), each with the time it was recorded. (Stamped with the flush's time, a block
read before another was written looked the newer of the two whenever the flush came after that
write -- a lock-free reservation does not flush -- and sampled LRU then took the blocks just
written first; likely why ``bench/host_profile.py --blocks 1024`` on an H100 host lost blocks of
the request it was reading, ``bench/results/gpu-20261207-s48``.) Small reads go into a dict (one row per slot); a large read keeps its
arrays as they are (a dict update cost ~30 µs per 256 blocks on the VM, paid again by every
layer of a layer-streamed get), and past ``TOUCH_ROWS_MAX`` rows they are stamped at once.

Ties: owned and called by the block lifecycle (``stores/blocks.py``); calls the index kernel.
"""
from __future__ import annotations

import time
from itertools import repeat

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
        self._small: dict[int, tuple[int, int]] = {}           # slot -> (version, time)
        self._rows: list[tuple[np.ndarray, np.ndarray, int]] = []  # large reads, with their time
        self._count = 0                                        # rows in _rows

    def record(self, slots: np.ndarray, versions: np.ndarray) -> None:
        """Record reads of ``slots`` at ``versions`` (a slot read twice is stamped twice at the
        flush, which is harmless)."""
        t = time.time_ns()
        if len(slots) <= SMALL_READ:
            self._small.update(zip(slots.tolist(), zip(versions.tolist(), repeat(t))))
            return
        self._rows.append((slots.astype(np.int64), versions.astype(np.int64), t))
        self._count += len(slots)
        if self._count > TOUCH_ROWS_MAX:
            self.flush()

    def flush(self) -> None:
        """Stamp the reads recorded since the last flush into the index (no lock needed)."""
        if not self._small and not self._rows:
            return
        n = len(self._small)
        slots = np.fromiter(self._small.keys(), dtype=np.int64, count=n)
        versions = np.fromiter((v for v, _ in self._small.values()), dtype=np.int64, count=n)
        times = np.fromiter((t for _, t in self._small.values()), dtype=np.int64, count=n)
        if self._rows:
            slots = np.concatenate([slots, *(r[0] for r in self._rows)])
            versions = np.concatenate([versions, *(r[1] for r in self._rows)])
            times = np.concatenate([times, *(np.full(len(r[0]), r[2], dtype=np.int64)
                                             for r in self._rows)])
            # each slot once (a layer-streamed get reads each block once per layer), with the
            # version and time of its latest read: sorted by slot, then time; the last of each
            order = np.lexsort((times, slots))
            slots, versions, times = slots[order], versions[order], times[order]
            last = np.empty(len(slots), dtype=np.bool_)
            last[:-1] = slots[1:] != slots[:-1]
            last[-1:] = True
            slots, versions, times = slots[last], versions[last], times[last]
            self._rows = []
            self._count = 0
        self._small.clear()
        ix.touch_batch(self.region.mem, self.entries_offset, slots, versions, times)
