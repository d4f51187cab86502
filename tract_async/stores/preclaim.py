"""Claiming chunks and evicting ahead of need, in this node's idle moments.

Pre-claimed chunks. A put whose blocks need more slots than this node's free lists hold
takes the global lock to claim and carve chunks (the journaled claim, the heap records and
slot tags: ~0.3-0.5 ms for a 16 MiB put on the H200 host, with the lock wait). A node that
streams puts pays that on each. So, after such a put, a background task (``PreClaimer.run``,
started by the Engine) waits until this node has been idle for a moment (no put in flight,
none started for ``PRECLAIM_IDLE_S``; a put that starts while it waits for the lock goes
first), then claims chunks ahead, a batch per hold of the lock: enough free slots for the
largest put seen so far (``EngineConfig.preclaim_bytes`` caps it; 0 turns it off), never more
than this node's share of the chunks still free (free chunks / live nodes: the others' shares
stay free for them), and not while another node asks for chunks. The next put of that size
reserves lock-free (index.py, "Who writes what"). Pre-claimed chunks are empty: they are the
first that ``BlockLifecycle._give_chunks_locked`` gives to a starving node, and close returns
them. When no chunk is free (a full prefix cache) nothing is claimed: see "Evicting ahead".

Evicting ahead. In a full prefix cache -- no chunk free, or this node's share of the free ones
used -- the same task, in the same idle moments, evicts this node's least recently used READY
blocks (sampled LRU, ``evict_lru_batch`` restricted to this node's chunks: another node's
victims would free *its* slots, not ours) until the free lists hold the headroom,
``EVICT_AHEAD_BATCH`` per hold of the lock. Without it every put of a full cache evicted under
the lock (``reservation.EVICT_AHEAD`` blocks beyond its need, so one small put in ~16-64 took the
lock, and every large one). The cost is the same as a put's own eviction, moved to idle time,
and that many blocks of this node's cache (at most its largest put) held free instead of
cached.

Idle means no put and no step-by-step read of this node in flight, and none started for
``PRECLAIM_IDLE_S``. A read counts because evicting ahead would take the blocks it reads
(their touches reach the region only after it) and turn it into a miss: a 24 MiB get right
after its put lost 184 of 780 blocks that way (``tests/engine/test_staged_put.py``). The
lifecycle reports its steps here (``put_started``, ``reserving``, ``read_started``,
``reading``, ``maybe_drained``); this module decides when to act on them.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Iterator, Protocol

import numpy as np

from ..errors import LockTimeout, RegionFull, TransferTimeout



class PreclaimHost(Protocol):
    """What the pre-claim task uses of its node's block lifecycle (``stores/blocks.py``'s
    ``BlockLifecycle``): a seam typed here, so that this module need not import that one (which
    imports this one: an import cycle, issue 37)."""
    cfg: Any
    layout: Any
    alloc: Any
    lock: Any
    region: Any
    stats: Any
    closing: bool

    @property
    def in_flight(self) -> int: ...
    def others_ask(self) -> bool: ...
    async def hold_lock(self, timeout: float | None) -> None: ...
    def evict_lru_locked(self, k: int, *, only_own: bool = ...) -> int: ...

PRECLAIM_IDLE_S = 0.0005
"""The task claims only after this node started no put for this long (and none is in
flight): it must not take the lock, or the loop, from a stream of puts."""
PRECLAIM_MAX_PAUSE_S = 0.05
"""While puts are in flight the task waits for them to drain, looking again at least this
often (a few wake-ups a second when a put is left half-filled, not thousands)."""
PRECLAIM_POLL_S = 0.0002
"""While it waits for the lock, it looks this often whether a put started (it then withdraws)."""
PRECLAIM_BATCH_CHUNKS = 32
"""Chunks claimed per hold of the lock (64 MiB of 2 MiB chunks, ~0.5 ms on the H200 host);
more wait for the next idle moment."""
EVICT_AHEAD_BATCH = 512
"""Blocks evicted per hold of the lock in a full region ("Evicting ahead"); more wait for the
next idle moment."""


class PreClaimer:
    """The pre-claim task of one node's ``BlockLifecycle`` (module docstring): its measure of
    idleness, its headroom (the largest put so far, capped), and the claim itself."""

    def __init__(self, blocks: PreclaimHost, cap_blocks: int) -> None:
        self._b = blocks
        self.headroom = 0
        """Free slots the task keeps: the largest put so far, at most ``cap_blocks``."""
        self._cap = cap_blocks
        self._refill = asyncio.Event()      # set: look at the free lists at the next idle moment
        self._drained = asyncio.Event()     # set: the last put or read in flight ended
        self._put_seq = 0                   # reservations started
        self._read_seq = 0                  # step-by-step reads started
        self._reserving = 0                 # locked reservations in flight (waiting counts)
        self._reads = 0                     # step-by-step reads in flight

    # -- what the lifecycle reports ------------------------------------------------------------
    def put_started(self) -> None:
        """A reservation starts (a put that starts while the task waits for the lock wins)."""
        self._put_seq += 1

    @contextlib.contextmanager
    def reserving(self) -> Iterator[None]:
        """Around a locked reservation: waiting for the lock is not idle."""
        self._reserving += 1
        try:
            yield
        finally:
            self._reserving -= 1
            self.maybe_drained()

    def read_started(self) -> None:
        self._read_seq += 1

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around a step-by-step read, from ``prepare_read`` to its validation."""
        self._reads += 1
        try:
            yield
        finally:
            self._reads -= 1
            self.maybe_drained()

    def maybe_drained(self) -> None:
        """After a publish or the end of a reservation or read: wake the waiting task if
        nothing is in flight any more."""
        if not self.busy():
            self._drained.set()

    def busy(self) -> bool:
        """A put (reserved blocks not yet whole, or a reservation in flight) or a read of this
        node in flight: not an idle moment."""
        return bool(self._b.in_flight or self._reserving or self._reads)

    def note_put(self, blocks: int) -> None:
        """After a reservation of ``blocks`` (and before a staged put's first stage, with the
        whole put's size: its stages reserve a part each): learn the headroom, and wake the
        task when the free lists hold less."""
        if blocks > self.headroom:
            self.headroom = min(blocks, self._cap)
        if self.headroom and self._b.alloc.free_slots(self._b.layout.block_bytes) < self.headroom:
            self._refill.set()

    # -- the task ------------------------------------------------------------------------------
    async def run(self) -> None:
        """The task (the Engine runs it until close): on each wake-up, once this node has
        started no put or read for ``PRECLAIM_IDLE_S`` and has none in flight, ``claim``."""
        while True:
            await self._refill.wait()
            self._refill.clear()
            while True:
                if self.busy():
                    # wait until they drain (publish and the end of a read set it), or look
                    # again after a while (a put left half-filled keeps blocks in flight)
                    self._drained.clear()
                    # ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11, wait_for
                    # returns the event's result and drops a cancellation that lands in the
                    # loop turn in which the event is set (a put publishing as the engine
                    # closes or its TaskGroup aborts). This task then went back to
                    # ``_refill.wait()`` (no timer, never set after close) and the engine's
                    # close waited for it forever (the signature of a CI hang of
                    # test_unsnapshotted_put[sim]; tests/engine/test_preclaim_cancel.py)
                    try:
                        async with asyncio.timeout(PRECLAIM_MAX_PAUSE_S):
                            await self._drained.wait()
                    except TimeoutError:
                        pass
                    continue
                seq = (self._put_seq, self._read_seq)
                await asyncio.sleep(PRECLAIM_IDLE_S)
                if seq == (self._put_seq, self._read_seq) and not self.busy():
                    break
            try:
                await self.claim(timeout=self._b.cfg.liveness_timeout_s)
            except (TransferTimeout, RegionFull, LockTimeout):
                pass    # the next put claims under the lock, as without pre-claiming

    async def claim(self, *, timeout: float | None) -> int:
        """Claim chunks until the free lists hold ``headroom`` slots, at most this node's share
        of the free chunks, unless another node asks for chunks; in a full region evict this
        node's LRU blocks instead. Returns the chunks claimed."""
        b = self._b
        bb = b.layout.block_bytes
        if b.closing or self.headroom - b.alloc.free_slots(bb) <= 0 or b.others_ask():
            return 0
        seq = self._put_seq
        acq = asyncio.ensure_future(b.hold_lock(timeout))
        while not acq.done():               # a put that starts meanwhile goes first
            await asyncio.wait([acq], timeout=PRECLAIM_POLL_S)
            if self._put_seq != seq and not acq.done():
                acq.cancel()
                await asyncio.wait([acq])
                if not acq.cancelled() and acq.exception() is None:
                    b.lock.release()        # granted as it was withdrawn
                return 0
        acq.result()
        evicted = 0
        try:
            b.lock.check_token()
            need = self.headroom - b.alloc.free_slots(bb)
            if need <= 0 or b.closing:      # close returns chunks: claim none after it
                return 0
            live = max(1, len(b.region.nodes.live_ids(timeout_s=b.cfg.liveness_timeout_s)))
            free = int(np.count_nonzero(~b.alloc.table.bitmap()))
            room = min(PRECLAIM_BATCH_CHUNKS, free // live)
            got = b.alloc.preclaim_locked(bb, need, b.lock, max_chunks=room) if room else 0
            if got < room or not room:      # no more chunks for us: make room in our own
                need = self.headroom - b.alloc.free_slots(bb)
                if need > 0 and b.alloc.holds_class(bb):
                    evicted = b.evict_lru_locked(min(need, EVICT_AHEAD_BATCH), only_own=True)
                    b.alloc.drain_returns()
                    b.stats.evicted_ahead += evicted
        finally:
            b.lock.release()
        b.stats.preclaimed_chunks += got
        if got == PRECLAIM_BATCH_CHUNKS or evicted == EVICT_AHEAD_BATCH:
            self._refill.set()              # more at the next idle moment
        return got
