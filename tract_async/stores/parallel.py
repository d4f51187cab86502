"""Parallel reads: each copy thread checks and revalidates the blocks it copies.

Why. A large read is three steps over all its blocks (``stores/blocks.py``): the index
snapshot (each key's home lines invalidated and read), the copy, and the revalidation after it
(each entry and slot tag read again). The copy already runs on several threads (the copy
gang, ``stores/copygang.py``); the two metadata steps ran on the event loop's thread alone.
For a 2048-block layer of a layer-streamed 128 MiB get they cost ~0.55 + 0.25 ms on the 2-core
VM against 2.6 ms of one-thread copy; on the 16-core H200 host, where the copy ran on eight
threads and the loop's Python ran 2-3x slower, the snapshot and revalidation of a layer cost
about as much as its copy (``bench/results/h200-20261204-gang-ab/layers-one-process-96507d1.log``:
prepare 0.35-0.6 ms + validate 0.3-0.4 ms against a 1-1.5 ms copy per 1024-block layer). So the
metadata has to scale with the copy threads, not stay on one.

How. The read's keys are cut into contiguous groups, one per thread (``cpucopy.threads_for``
of its bytes); each group is one ``gangcopy.get_checked`` call -- snapshot of its keys, the
checks, the copy of its rows, the revalidation of its blocks -- the steps of the lock-free
read of ``region/index.py`` in their order, for a subset of the blocks. The copy gang's
workers run the other groups (``KIND_GET_CHECKED``) while the loop's thread runs the first --
when a group is at most ``routing.LOOP_SHARE_MAX_BYTES`` (a larger one would hold the loop
for milliseconds); else the workers run every group and the loop waits.
Each group's snapshot precedes its own copy and its revalidation follows it, which is all the
seqlock read needs per block: a block is good when the entry read after its copy still names
the version read before it. The read is good when every group is.

When a group is not good -- a key absent, a layer not landed, payload bounds that do not fit, a
block that changed during its copy -- the read gives up (``get`` returns None) and the
step-by-step path of ``RegionStore._get`` reads again from the start: it waits where the caller
allowed it, raises the precise error, and overwrites whatever the groups wrote. Nothing here
raises for the data.

Waiting first. A layer-streamed consumer asks before its producer publishes. ``get`` waits
(when given a timeout) for the last key alone to have what the read needs -- the producer
publishes a batch's layer in key order, so the last key is the last to show it
(``waits.ready_state``) -- and then reads all of them in parallel; a group that still finds a
key without the layer sends the read to the step-by-step path, which waits for all of them.

What stays on the loop: the wait, splitting the keys (numpy views: no copy), the argument
words of each group, and after the groups: the counters and LRU touches of a good read
(``BlockLifecycle.count_read``) and, in transfer-only mode, the consumption.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

import tract_kernels as K

from .. import arrays
from ..errors import TransferTimeout
from ..keys import KeyBatch
from ..region import gangcopy as G
from ..region.index import SNAP_COLS, SNAP_POFF, SNAP_SLOT, SNAP_VERSION
from . import plan as kvplan
from . import routing as R



class ParallelHost(Protocol):
    """What the parallel reads use of their ``RegionStore`` (``stores/region.py``): typed here
    so that this module need not import that one, which imports this one (an import cycle,
    issue 37)."""
    layout: Any
    blocks: Any
    copier: Any
    geo: Any
    index: Any
    mem: Any
    phases: Any
    region: Any

class ParallelReads:
    """The parallel read of one region store (module docstring)."""

    def __init__(self, store: ParallelHost) -> None:
        self.store = store
        self.enabled = True
        """Off: every read takes the step-by-step path (benchmarks compare the two)."""
        self.hold_after_snapshot: np.ndarray | None = None
        """Test seam: two uint64 words; while set, every worker's group stores 1 in the second
        after its snapshot and waits while the first is not 0 (``gangcopy.get_checked``)."""

    def _bytes(self, n: int, layer: int | None) -> int:
        """Bytes a read of ``n`` blocks (one layer, or all for None) moves."""
        lay = self.store.layout
        return n * lay.layer_bytes * (lay.num_layers if layer is None else 1)

    def takes(self, n: int, layer: int | None) -> bool:
        """A CPU read of ``n`` blocks (``layer``, or every layer for None) that this path may
        take: the hardware backend, at least ``PARALLEL_MIN_BLOCKS`` blocks, at least two
        threads by ``threads_for``, no read-ahead pair configured, no test seam between the
        snapshot and the copy."""
        st = self.store
        c = st.copier
        nbytes = self._bytes(n, layer)
        return (self.enabled and n >= R.PARALLEL_MIN_BLOCKS and not c.read_ahead
                and st.region.mem[K.MEM_BACKEND] == K.BACKEND_HW
                and st.blocks.pause_after_snapshot is None
                and R.threads_for(nbytes, c.copy_threads) >= 2)

    async def get(self, kb: KeyBatch, out: Any, layer: int | None,
                  timeout: float | None) -> np.ndarray | None:
        """Read ``kb``'s blocks into ``out`` in parallel groups after waiting (``timeout``) for
        the last key; the snapshot of every block once all groups are good, else None (the
        caller's step-by-step read decides; module docstring)."""
        keys, words = kb.keys, kb.words
        st = self.store
        b = st.blocks
        b.preclaimer.read_started()            # as ``prepare_read``: reads are not idle time
        n = len(keys)
        lay = st.layout
        tmpl, pos_step = kvplan.plan_template(lay, layer, n)
        nbytes = self._bytes(n, layer)
        gang = st.copier.idle_gang()
        if gang is None:
            return None
        if timeout is not None and timeout > 0:
            last = words[n - 1:]
            try:
                await b.wait_ready(last, b.snapshot(last), layer, timeout)
            except TransferTimeout:      # the step-by-step read looks at all of them and
                return None              # says how many did not come
            gang = st.copier.idle_gang()          # the wait let other tasks run
            if gang is None:
                return None
        parts = min(R.threads_for(nbytes, st.copier.copy_threads), gang.workers + 1,
                    n // (R.PARALLEL_MIN_BLOCKS // 4))
        # the loop's thread reads a group itself only when a group is small enough to hold
        # the loop for (``routing.LOOP_SHARE_MAX_BYTES``); else every group goes to a worker
        loop_reads = nbytes // max(1, parts) <= R.LOOP_SHARE_MAX_BYTES
        if not loop_reads:
            parts = min(parts, gang.workers)
        if parts < 2:
            return None
        ph = st.phases
        t0 = time.perf_counter_ns() if ph is not None else 0
        words = np.ascontiguousarray(words, dtype=np.uint64)
        snap = np.empty((n, SNAP_COLS), dtype=np.int64)
        ok = np.zeros(n, dtype=np.bool_)
        cuts = [n * k // parts for k in range(parts + 1)]
        dst = arrays.data_ptr(out)
        g, ag = st.geo, b.ageo
        tgeo = st.index.tgeo
        nt = nbytes >= R.NT_READ_BYTES
        whole = layer is None
        word, bit = (0, 0) if whole else divmod(layer, 64)
        chunks_end = ag.chunks_offset + ag.nchunks * ag.chunk_bytes
        fixed = (g.entries_offset, st.index.mask, g.max_probe, g.lanes, ag.chunks_offset,
                 chunks_end, lay.block_bytes, pos_step, b.ns_tag)
        validate = b.validate_reads
        jobs = []
        empty = np.zeros((0, 3), dtype=np.int64)
        for k in range(1 if loop_reads else 0, parts):
            k0, k1 = cuts[k], cuts[k + 1]
            a = np.zeros(G.GA_WORDS, dtype=np.int64)
            a[:G.GA_FIXED] = fixed
            a[G.GA_TGEO], a[G.GA_TGEO_LEN] = tgeo.ctypes.data, tgeo.shape[0]
            a[G.GA_KEYS], a[G.GA_NKEYS] = words[k0:k1].ctypes.data, k1 - k0
            a[G.GA_TMPL], a[G.GA_TMPL_ROWS] = tmpl.ctypes.data, tmpl.shape[0]
            a[G.GA_SNAP], a[G.GA_OK] = snap[k0:k1].ctypes.data, ok[k0:k1].ctypes.data
            a[G.GA_VALIDATE], a[G.GA_WHOLE], a[G.GA_NT] = validate, whole, nt
            a[G.GA_WORD], a[G.GA_BIT] = word, 1 << bit if bit < 63 else -(1 << 63)
            if self.hold_after_snapshot is not None:
                a[G.GA_HOLD] = self.hold_after_snapshot.ctypes.data
            jobs.append((G.KIND_GET_CHECKED, empty, dst + k0 * pos_step, a))
        c1 = cuts[1]
        mem = st.mem

        def own() -> int:
            return int(G.get_checked(mem, *fixed, tgeo, words[:c1], tmpl, dst, validate, whole,
                                     word, np.uint64(1 << bit), nt, snap[:c1], ok[:c1]))

        mine = await gang.run_jobs(mem, jobs, own if loop_reads else None)
        results = ([mine] if loop_reads else []) + [int(a[G.GA_RESULT]) for _, _, _, a in jobs]
        b.stats.parallel_read_groups += parts
        if any(results):
            b.stats.parallel_reads_redone += 1
            return None
        b.count_read(keys, ok, 0, nbytes, snap[:, SNAP_SLOT], snap[:, SNAP_VERSION], snap[:, SNAP_POFF],
                     layer)
        b.stats.parallel_reads += 1
        if ph is not None:
            ph.add("parallel", t0)
        return snap
