"""Doorbells: a consumer waiting on the region wakes microseconds after the publication.

Why. Memory is the only signal that crosses the hosts of a CXL rack, so a wait on the region
is, at bottom, a poll -- and a poll is either late (it sleeps between looks) or costly (it
spins, and on a 2-core host a spinner takes the core the producer needs). Measured on the
2-core VM before this module: a 64 KiB handoff spent ~150 µs of its ~280 µs between the
producer's publish and the consumer noticing it. But most producers and consumers share a host
(a prefill and a decode worker of one box, every test, every benchmark), and processes of one
host have real wake-ups. So a wait takes two paths at once:

* **the doorbell** (same host): each node binds a Unix datagram socket in the abstract
  namespace (no file: nothing is left behind), named by the region's uuid and the node id. A
  node with waits pending says so in its ``DOORBELL`` line of the region; a producer, right
  after it publishes layer bits or READY, reads every node's line and sends one empty datagram
  to each node that waits. The consumer's event loop has the socket in its selector
  (``add_reader``): the datagram wakes it, and it re-checks its pending waits -- no thread, no
  sleeping poll, 0 % of a core while idle. A datagram to a node on another host finds no
  socket of that name here and fails at once (harmless: that node polls).
* **the poll** (any host): a wait still re-checks on a timer, from ``SAFETY_FIRST_S`` doubling
  to ``SAFETY_MAX_S``, so a lost datagram (a full socket buffer) costs milliseconds, never a
  hang. When some live node runs on another host (``host_id`` differs in the node table), the
  waits also run the spinning thread poll of ``waits.py``, as before, since no doorbell can
  reach across hosts.

The race (Dekker's): a consumer stores ``waiting`` (flush, fence), *then* re-reads the index;
a producer stores its layer bits / READY (fence), *then* reads ``waiting``. With a full fence
between each side's store and load, at least one side sees the other's store: either the
consumer finds the block on its re-read, or the producer finds the consumer waiting and rings.
On non-coherent memory the consumer flushes its line and the producer invalidates before it
reads -- the sites ``doorbell.waiting.flush`` and ``doorbell.waiting.invalidate``, each proven
needed by a test under the incoherent backend (``tests/engine/test_doorbell.py``).

``DOORBELL`` (``layout.py``) is one line per node, written only by the node's event-loop
thread.
"""
from __future__ import annotations

import asyncio
import errno
import socket
import time
from typing import Any, Callable

import numpy as np
from numba import njit

import tract_kernels as K

from ..errors import RootNameNotFound
from ..region import Region
from ..region import index as ix
from ..region import layout as L
from ..region.nodes import all_on_host

SECTION = "sync.doorbells"

S_DB_FLUSH = K.site("doorbell.waiting.flush")
S_DB_READ = K.site("doorbell.waiting.invalidate")

_F = {n: L.DOORBELL.dtype.fields[n][1] for n in L.DOORBELL.dtype.names}
F_WAITING, F_EPOCH = _F["waiting"], _F["epoch"]

MAX_RING_NODES = 63
"""Nodes a producer's look covers (bits of one int64 mask); nodes with higher ids poll."""

SAFETY_FIRST_S = 0.001
SAFETY_MAX_S = 0.02
HOSTS_CHECK_S = 0.5
"""How often a wait re-reads the node table to learn whether every live node shares its host."""


def section_bytes(max_nodes: int) -> int:
    return max_nodes * L.DOORBELL.itemsize


@njit(cache=True)            # holds the GIL: a few lines (fused.py, "Holding the GIL")
def set_waiting(m, off, waiting, epoch):
    """Store this node's line (waiting count, epoch), flush, then a full fence: the index
    re-read that follows cannot pass the store (the consumer's half of the race)."""
    K.store(m, off + F_EPOCH, np.uint64(epoch))
    K.store(m, off + F_WAITING, np.uint64(waiting))
    K.flush(m, off, S_DB_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def waiting_mask(m, dboff, nodes):
    """Bit n set: node n says it waits. Every line is invalidated, one fence, then read (the
    producer's half of the race: the fence also orders the publish's stores before the reads)."""
    K.full_fence(m)
    for n in range(nodes):
        K.invalidate(m, dboff + n * L.LINE_BYTES, S_DB_READ)
    K.full_fence(m)
    mask = np.int64(0)
    for n in range(nodes):
        if K.load(m, dboff + n * L.LINE_BYTES + F_WAITING) != 0:
            mask |= np.int64(1) << np.int64(n)
    return mask


@njit(cache=True)            # holds the GIL (fused.py, "Holding the GIL")
def publish_and_look(m, eoff, slots, lo_bits, hi_bits, all_lo, all_hi, dboff, nodes):
    """``index.publish_layers``, then ``waiting_mask`` (-1 when the region has no doorbells):
    one kernel call for the producer's whole publish."""
    ix.publish_layers(m, eoff, slots, lo_bits, hi_bits, all_lo, all_hi)
    if dboff < 0:
        return np.int64(0)
    return waiting_mask(m, dboff, nodes)


@njit(cache=True)            # holds the GIL (fused.py, "Holding the GIL")
def publish_lines_and_look(m, eoff, slots, lines, lo_val, hi_val, all_lo, all_hi, dboff, nodes):
    """``index.publish_layers_lines`` (a batch that recorded its entries' words), then
    ``waiting_mask``, as ``publish_and_look``."""
    ix.publish_layers_lines(m, eoff, slots, lines, lo_val, hi_val, all_lo, all_hi)
    if dboff < 0:
        return np.int64(0)
    return waiting_mask(m, dboff, nodes)


def _name(region: Region, node_id: int) -> bytes:
    return b"\0tract-db-%s-%d" % (region.uuid.hex.encode(), node_id)


class _Wait:
    __slots__ = ("check", "fut")

    def __init__(self, check: Callable[[], Any], fut: asyncio.Future) -> None:
        self.check = check
        self.fut = fut


class Doorbell:
    """One node's doorbell: its socket on the event loop, its ``DOORBELL`` line, and the waits
    pending on it. ``enabled`` is False for a region without the section (the waits then poll
    only)."""

    def __init__(self, region: Region, node_id: int, epoch: int) -> None:
        self.region = region
        self.node_id = node_id
        self.epoch = epoch
        self.max_nodes = min(region.max_nodes, MAX_RING_NODES)
        try:
            sec = region.section(SECTION)
        except RootNameNotFound:
            sec = None
        self.offset = -1 if sec is None else sec.offset_bytes
        self.enabled = (sec is not None and node_id < MAX_RING_NODES
                        and sec.nbytes >= section_bytes(self.max_nodes))
        if not self.enabled:
            self.offset = -1
        self._waits: set[_Wait] = set()
        self._rx: socket.socket | None = None
        self._tx: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._names = [_name(region, n) for n in range(self.max_nodes)]
        self._hosts_at = 0.0
        self._one_host = True
        self.rings_sent = 0
        self.rings_received = 0
        self.woken = 0
        """Waits that the doorbell (not the timer) satisfied."""
        self.phases: Any = None
        """A ``PhaseTimes`` (``Engine.time_phases``): ``check_all`` stamps ``woken`` in it."""

    # -- lifetime ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the socket and put it in the running loop's selector. A name already bound (a
        paused earlier incarnation of this node id still holds it) leaves this node without a
        doorbell: its waits poll."""
        if not self.enabled or self._rx is not None:
            return
        self._write(0)     # a crashed predecessor of this node id may have left "waiting" set
        self._loop = asyncio.get_running_loop()
        self._tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                 | socket.SOCK_CLOEXEC)
        rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                           | socket.SOCK_CLOEXEC)
        try:
            rx.bind(self._names[self.node_id])
        except OSError:
            rx.close()
            return
        self._rx = rx
        self._loop.add_reader(rx.fileno(), self._on_ring)

    def stop(self) -> None:
        """Leave the selector, close the sockets, clear this node's line; pending waits fall back
        to their timers. Idempotent."""
        rx, self._rx = self._rx, None
        if rx is not None:
            try:
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.remove_reader(rx.fileno())
            finally:
                rx.close()
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.close()
        if self.enabled and self._waits:
            self._waits.clear()
            self._write(0)

    # -- the consumer's side -------------------------------------------------------------------
    def _write(self, waiting: int) -> None:
        set_waiting(self.region.mem, self.offset + self.node_id * L.LINE_BYTES, waiting,
                    self.epoch)

    def one_host(self, liveness_timeout_s: float) -> bool:
        """Every live node runs on this host (cached for ``HOSTS_CHECK_S``): the doorbell
        reaches every producer, so a wait needs no spinning poll."""
        now = time.monotonic()
        if now >= self._hosts_at:
            self._hosts_at = now + HOSTS_CHECK_S
            nodes = self.region.nodes.all(timeout_s=liveness_timeout_s)
            me = next((n.host_id for n in nodes if n.node_id == self.node_id), None)
            self._one_host = all_on_host(nodes, me)
        return self._one_host

    def add(self, check: Callable[[], Any]) -> "_Wait":
        """Register a pending wait: ``check()`` (re-read the index) runs on every ring and
        returns a result to finish the wait with, or None to keep waiting; ``wait.fut`` gets
        that result (``rearm`` gives it a fresh future after a timer round). The caller must
        re-check once *after* this call (the race, module docstring) and ``remove`` it."""
        w = _Wait(check, asyncio.get_running_loop().create_future())
        self._waits.add(w)
        if self.enabled and len(self._waits) == 1:
            self._write(1)
        return w

    @staticmethod
    def rearm(w: "_Wait") -> None:
        if w.fut.done():
            w.fut = asyncio.get_running_loop().create_future()

    def remove(self, w: "_Wait") -> None:
        if w not in self._waits:
            return
        self._waits.discard(w)
        if self.enabled and not self._waits:
            self._write(0)

    @property
    def receiving(self) -> bool:
        return self._rx is not None

    def _on_ring(self) -> None:
        rx = self._rx
        if rx is None:
            return
        while True:
            try:
                rx.recv(16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            self.rings_received += 1
        self.check_all()

    def check_all(self) -> int:
        """Re-check every pending wait; finish those whose check returns a result."""
        done = 0
        for w in list(self._waits):
            if w.fut.done():
                continue
            r = w.check()
            if r is not None:
                w.fut.set_result(r)
                done += 1
        if done and self.phases is not None:
            self.phases.stamp("woken")
        self.woken += done
        return done

    # -- the producer's side -------------------------------------------------------------------
    def ring(self, mask: int, *, threadsafe: bool = False) -> None:
        """Send one datagram to each node in ``mask`` (from ``publish_and_look``). A node on
        another host has no socket of that name here: the send fails at once and is ignored.
        ``threadsafe``: called from another thread than the loop's (the CUDA poller's early
        publish); our own waits are then checked through ``call_soon_threadsafe``."""
        if not mask:
            return
        if mask >> self.node_id & 1:        # our own waits (another engine of this process's
            mask &= ~(1 << self.node_id)    # loop, or a layer wait beside its producer)
            loop = self._loop
            if self._waits and loop is not None:
                if threadsafe:
                    try:
                        loop.call_soon_threadsafe(self.check_all)
                    except RuntimeError:    # the loop closed: nobody waits any more
                        pass
                else:
                    loop.call_soon(self.check_all)
        tx = self._tx
        if tx is None or not mask:
            return
        n = 0
        while mask:
            low = mask & -mask
            node = low.bit_length() - 1
            mask ^= low
            if node >= self.max_nodes:
                break
            try:
                tx.sendto(b"", self._names[node])
                n += 1
            except OSError as e:
                if e.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN,
                                   errno.EWOULDBLOCK, errno.ENOBUFS):
                    raise
        self.rings_sent += n
