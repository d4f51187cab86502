"""Transfer-only mode's last step of a read: free the blocks once their consumer has read
every layer.

A block put in transfer mode (``EngineConfig.mode == "transfer"``) is meant for one consumer:
after a validated read of its last layer (or of all layers at once) its entry is evicted and
its slot freed, under the global lock. Blocks nobody consumes are freed by their transfer
deadline instead (``BlockLifecycle.maintain``).

Why a module of its own (issue 37): the consumed-layer record, the deferred frees and their
background task were four methods and three fields of the block lifecycle; here they depend
only on the lock, the index and the evictor.
"""
from __future__ import annotations

import asyncio

import numpy as np

from ..config import EngineConfig
from ..errors import TractError
from ..keys import KeyBatch
from ..region import index as ix
from ..region.index import SNAP_FLAGS, SNAP_POFF, SNAP_SLOT, SNAP_VERSION
from ..sync.lock import GlobalLock
from .eviction import Evictor
from .reservation import hold_lock
from .stats import StoreStats

Batch = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Consumed blocks to free: slots, versions, payload offsets, key words."""


class Consumer:
    """Frees consumed transfer-only blocks for one node (module docstring). Created and owned
    by the ``BlockLifecycle``."""

    def __init__(self, cfg: EngineConfig, lock: GlobalLock, index: ix.PrefixIndex,
                 evictor: Evictor, stats: StoreStats) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.lock = lock
        self.index = index
        self.evictor = evictor
        self.stats = stats
        self.layers_read: dict[bytes, int] = {}
        """Per key of a block not yet consumed: the layers its consumer has read so far."""
        self.pending: list[Batch] = []
        """Consumed batches waiting for the background free (``defer_consume``)."""
        self.task: asyncio.Task[None] | None = None
        """The background free of ``pending`` (``_drain``), while it runs."""

    async def consume(self, kb: KeyBatch, snap: np.ndarray, layer: int | None) -> None:
        """Transfer-only mode, after a validated read: free blocks once their consumer has read
        every layer (``snap`` as validated).

        Freeing takes the global lock. With ``EngineConfig.defer_consume`` the read does not
        wait for it: the blocks go to a background task that frees every pending batch under
        one hold (``_drain``). Why: on the H100 serving run of 2026-12-06 at 4d2730c
        (``bench/results/gpu-20261206-s38``), every layer of a 512-block prompt reached the
        decode worker 2-4 ms after its publication except the last, 50-83 ms after it: the
        read of the last layer is the one that consumes, and it waited for the lock."""
        if self.cfg.mode != "transfer" or not snap[:, SNAP_FLAGS].any():
            return
        keys, words = kb.keys, kb.words
        slots, versions, poffs = snap[:, SNAP_SLOT].copy(), snap[:, SNAP_VERSION].copy(), snap[:, SNAP_POFF].copy()
        done = []
        for i, k in enumerate(keys):
            if layer is None:
                done.append(i)
            else:
                seen = self.layers_read.get(k, 0) | (1 << layer)
                if seen == (1 << self.layout.num_layers) - 1:
                    self.layers_read.pop(k, None)
                    done.append(i)
                else:
                    self.layers_read[k] = seen
        if not done:
            return
        batch = (slots[done], versions[done], poffs[done], np.ascontiguousarray(words[done]))
        if not self.cfg.defer_consume:
            await self._free([batch])
            return
        self.pending.append(batch)
        t = self.task
        if t is None or t.done():
            self.task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """``defer_consume``: free the pending consumed batches, all of them under one hold of
        the lock, until none is left. A lock that cannot be had (the node revoked or closing)
        leaves them to the transfer deadline (``deferred_consume_failures``)."""
        while self.pending:
            batches, self.pending = self.pending, []
            try:
                await self._free(batches)
            except TractError:
                self.stats.deferred_consume_failures += sum(len(b[0]) for b in batches)

    async def _free(self, batches: list[Batch]) -> None:
        slots = np.concatenate([b[0] for b in batches])
        versions = np.concatenate([b[1] for b in batches])
        poffs = np.concatenate([b[2] for b in batches])
        words = np.ascontiguousarray(np.concatenate([b[3] for b in batches]))
        await hold_lock(self.lock, self.stats, timeout=max(5.0, self.cfg.liveness_timeout_s * 4))
        try:
            check = np.zeros(len(slots), dtype=np.bool_)
            self.index.revalidate(slots, versions, poffs, words, check)
            # only READY entries: a RESERVED one (every layer read before its producer stored
            # READY) is its live producer's to write; its transfer deadline frees it instead
            now = self.index.snapshot(words)
            gone = [int(slots[i]) for i in range(len(slots))
                    if check[i] and now[i, 0] == slots[i] and now[i, 2] == ix.READY]
            self.evictor.slots(gone)
            self.stats.consumed += len(gone)
        finally:
            self.lock.release()

    async def drain(self) -> None:
        """Wait until the deferred frees queued so far are done (``defer_consume``)."""
        while (t := self.task) is not None and not t.done():
            await asyncio.shield(t)
