"""The node table: join, heartbeat, leave, liveness. Layout: ``layout.NODE`` (one line a node).

Who writes: only the node that owns an id writes its line (single writer per line). Ownership
passes by *leaving* or by *death*: a joiner may take an id whose line says FREE or LEFT, or whose
heartbeat is older than the liveness timeout. No atomics exist across hosts, so two protocols
keep two claimants apart:

* On one host, an open-file-description lock (``F_OFD_SETLK``) on byte ``NODE_LOCK_BASE + id``
  of the region file. The kernel drops it when its holder dies (even by SIGKILL), and OFD locks
  conflict between two opens in the same process, so two Engine objects in one process are kept
  apart too. While it is held, the id is in use whatever the heartbeat says.
* Across hosts, an id whose heartbeat is fresh is refused (``NodeIdInUse``). Two hosts racing for
  one dead id (a misconfiguration: ids are assigned by configuration) is caught on the next
  heartbeat: each beat re-reads ``owner_nonce`` and the loser raises ``NodeEvicted`` and stops.

Two verdicts on a node (``NodeInfo``):

* ``live``: state LIVE and ``heartbeat_ns`` (CLOCK_REALTIME) younger than the timeout: a
  snapshot verdict. Rack clocks must agree to well within the timeout (NTP/PTP).
* ``dead``: the verdict that *takes things away* (a revoked lock, reclaimed chunks, a new lock
  manager). Not LIVE; or LIVE, not ``live``, *and* its ``heartbeat_seq`` has stood still while
  this process's own beat loop (``beat_until_stopped``) stamped at least
  ``max(3, timeout / (4 * interval))`` beats. Why the second condition: a snapshot taken just
  after a stall of the whole host (a paused VM, a stopped process group, a clock stepped
  forward) finds every node "stale" until their beat threads have run again; the manager's own
  beat thread may run first and revoke a live holder (the stress test's intermittent
  ``LockRevoked``). A stall stops this process's own beats too, so it never adds to the count,
  and once the host runs again every live node beats within a few intervals. A real crash is
  counted while it happens: the verdict comes at the same moment as ``not live`` for a process
  that has been reading the table (the lock manager and its candidates read it at least every
  quarter timeout), a quarter timeout later for one that reads it for the first time. A
  process with no beat loop of its own (a one-shot tool) has nothing to count with: there
  ``dead`` is ``not live``.

Clock first: ``info`` and ``all`` read the clock *before* the node lines. A reader preempted
between the two (a loaded host, the GIL) would otherwise compare a line read long ago with a late
clock and find stale a node that beat meanwhile. Clock first, a delay only makes a line look
younger than it is: ``live`` may turn False late, never early.

Publish order on join: every field with state still as before, flush, then state = LIVE, flush.
"""
from __future__ import annotations

import math
import os
import secrets
import socket
import time
import zlib
from dataclasses import dataclass

import numpy as np
from numba import njit

import tract_kernels as K
from tract_kernels.intrinsics import aload64, monotonic_ns, realtime_ns, usleep

from ..errors import NodeEvicted, NodeIdInUse, NodeIdOutOfRange
from . import layout as L
from .memview import MemView
from .ofd import ofd_lock, ofd_unlock

S_NODE_WRITE = K.site("nodes.line.flush")
S_NODE_STATE = K.site("nodes.state.flush")
S_NODE_READ = K.site("nodes.read.invalidate")
S_NODE_BEAT = K.site("nodes.heartbeat.flush")

NODE_LOCK_BASE = 1 << 40
"""Byte offset (past any region's end) of the per-node OFD lock bytes in the region file."""

DEFAULT_LIVENESS_TIMEOUT_S = 1.0

CONFIRM_MIN_BEATS = 3
"""The fewest of this process's own beats across which a stale node's ``heartbeat_seq`` must
stand still before it is ``dead`` (module docstring); more when the timeout spans more beats."""

_F = {name: L.NODE.dtype.fields[name][1] for name in L.NODE.dtype.names}


_O_STATE, _O_NONCE, _O_BEAT, _O_SEQ = (_F["state"], _F["owner_nonce"], _F["heartbeat_ns"],
                                       _F["heartbeat_seq"])
BEAT_STOP_POLL_US = 10_000
"""How often a sleeping ``_beat_loop`` looks at its stop word: the longest ``Engine.close`` waits."""


@njit(cache=True, nogil=True)
def _stamp(m, off):
    """One beat's stores: ``heartbeat_ns`` (CLOCK_REALTIME) and ``heartbeat_seq + 1`` of the
    node line at ``off``, flushed, fenced. Only the owner writes its line, so its cached copy
    of the sequence is current."""
    seq = K.load(m, off + _O_SEQ)
    K.store(m, off + _O_BEAT, realtime_ns())
    K.store(m, off + _O_SEQ, seq + np.uint64(1))
    K.flush(m, off, S_NODE_BEAT)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def _beat_loop(m, off, nonce, interval_ns, stop_addr):
    """Beat every ``interval_ns`` until the word at ``stop_addr`` is non-zero (returns 0) or the
    line no longer names this owner as LIVE (returns 1: taken over). One beat: invalidate the
    line, check owner and state, then ``heartbeat_ns`` and ``heartbeat_seq + 1``, flush, fence
    (the same stores as ``NodeTable.heartbeat``).

    Why jitted: it runs for the node's whole life without the GIL, so no Python-level stall of
    the process (a long numba compile, a C call that keeps the GIL, a busy thread) can starve
    the heartbeat and get a live node judged dead, its lock revoked and its chunks reclaimed."""
    while True:
        K.invalidate(m, off, S_NODE_READ)
        K.full_fence(m)
        if K.load(m, off + _O_NONCE) != np.uint64(nonce) or K.load(m, off + _O_STATE) != L.NODE_LIVE:
            return 1
        _stamp(m, off)
        due = monotonic_ns() + interval_ns
        while True:
            if aload64(stop_addr) != 0:
                return 0
            now = monotonic_ns()
            if now >= due:
                break
            usleep(min(BEAT_STOP_POLL_US, max(1, (due - now) // 1000)))


def host_id() -> int:
    """A 64-bit id for this host: hostname and boot id."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return zlib.crc32(socket.gethostname().encode()) << 32 | zlib.crc32(boot.encode())


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """A snapshot of one node line, as read from memory."""
    node_id: int
    state: int
    epoch: int
    owner_nonce: int
    pid: int
    heartbeat_ns: int
    heartbeat_seq: int
    host_id: int
    joined_ns: int
    heartbeat_age_s: float
    live: bool
    """State LIVE and a heartbeat younger than the timeout (a realtime snapshot)."""
    dead: bool
    """Not LIVE, or not ``live`` and silent across several of this process's own beats
    (module docstring); ``not live`` where this process runs no beat loop."""

    @property
    def state_name(self) -> str:
        return {L.NODE_FREE: "free", L.NODE_LIVE: "live", L.NODE_LEFT: "left"}.get(self.state, "?")


def all_on_host(nodes: list[NodeInfo], host: int | None, *, stale_too: bool = False) -> bool:
    """Every node that counts runs on ``host`` (``host_id``): the LIVE ones with a fresh
    heartbeat (``live``); with ``stale_too`` also those LIVE but stale and not yet ``dead`` (a
    paused process that may act again once it resumes). The doorbell and the lock manager's
    bell need no poll across hosts when this holds."""
    return all(n.host_id == host for n in nodes
               if n.live or (stale_too and n.state == L.NODE_LIVE and not n.dead))


@dataclass(kw_only=True)
class NodeHandle:
    """Proof of membership: returned by ``join``, needed by ``heartbeat`` and ``leave``."""
    node_id: int
    epoch: int
    owner_nonce: int
    lock_fd: int
    left: bool = False


def _node_info(node_id: int, rec: tuple, now_ns: int, timeout_s: float,
               silent: bool = True) -> NodeInfo:
    """A NodeInfo from one ``layout.NODE`` record (as ``tolist()`` gives it, in field order).
    ``silent``: its sequence stood still across enough of our own beats (``NodeTable.all``);
    True where nothing counts, so that ``dead`` is ``not live``."""
    state, epoch, nonce, pid, hb, seq, host, joined = rec
    age = (now_ns - hb) / 1e9 if hb else float("inf")
    live = state == L.NODE_LIVE and age < timeout_s
    return NodeInfo(node_id=node_id, state=state, epoch=epoch, owner_nonce=nonce, pid=pid,
                    heartbeat_ns=hb, heartbeat_seq=seq, host_id=host, joined_ns=joined,
                    heartbeat_age_s=age, live=live, dead=not live and silent)


class NodeTable:
    """The region's node table. Obtained as ``region.nodes``."""

    def __init__(self, view: MemView, *, path: str, offset_bytes: int, max_nodes: int) -> None:
        """``view``: the region, for its memory (read on every access: ``memview``); ``path``:
        the region file, whose bytes past the end carry the per-node OFD locks; ``offset_bytes``,
        ``max_nodes``: where the table lies and how many lines it has (from the header)."""
        self._view = view
        self._path = path
        self._offset = offset_bytes
        self._max_nodes = max_nodes
        self._handles: list[NodeHandle] = []
        # the silence counter behind NodeInfo.dead (module docstring):
        self._beating: dict[int, tuple[int, float]] = {}
        """node id -> (owner nonce, interval_s) of each beat loop running in this process"""
        self._seen: dict[int, tuple[int, int, int]] = {}
        """node id -> (owner nonce, heartbeat_seq, our own heartbeat_seq when we first read that
        pair): how many of our beats a node's line has stayed unchanged"""
        self._seen_by: tuple[int, int] | None = None
        """(node id, owner nonce) of our own line that ``_seen`` counts in"""

    def line_offset(self, node_id: int) -> int:
        """Byte offset of node ``node_id``'s line. Raises NodeIdOutOfRange."""
        n = self._max_nodes
        if not isinstance(node_id, (int, np.integer)) or not 0 <= node_id < n:
            raise NodeIdOutOfRange(f"node id {node_id!r} out of range: this region has "
                                   f"max_nodes={n}, so ids 0..{n - 1}")
        return self._offset + int(node_id) * L.NODE.itemsize

    def heartbeat_offset(self, node_id: int) -> int:
        """Region offset of node ``node_id``'s ``heartbeat_ns`` word (CLOCK_REALTIME ns), for
        kernels that judge a node's own liveness (the holder lease, ``sync/slots.py``)."""
        return self.line_offset(node_id) + int(_O_BEAT)

    def info(self, node_id: int, *, timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
             now_ns: int | None = None) -> NodeInfo:
        """Read node ``node_id``'s line from memory (invalidate first). Takes no lock."""
        off = self.line_offset(node_id)
        raw = np.zeros(L.NODE.itemsize, dtype=np.uint8)
        now = time.time_ns() if now_ns is None else now_ns    # before the read ("clock first")
        K.read_bytes(self._view.mem, off, raw.ctypes.data, raw.size, S_NODE_READ)
        return _node_info(int(node_id), raw.view(L.NODE.dtype)[0].tolist(), now, timeout_s)

    def all(self, *, timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
            confirm: bool = True) -> list[NodeInfo]:
        """Every node line, read from memory in one call (recovery reads the table on every
        chunk claim: one read instead of ``max_nodes``, ~10 instead of ~100 µs for 8 nodes).

        Each call also advances the silence counts behind ``NodeInfo.dead`` (module
        docstring). ``confirm=False`` gives the snapshot verdict (``dead = not live``): for an
        operator's repair, which must not wait for a count to build up."""
        n = self._max_nodes
        raw = np.zeros(n * L.NODE.itemsize, dtype=np.uint8)
        now = time.time_ns()                                    # before the read ("clock first")
        K.read_bytes(self._view.mem, self._offset, raw.ctypes.data, raw.size, S_NODE_READ)
        recs = raw.view(L.NODE.dtype).tolist()
        silent = self._silence(recs, timeout_s)
        if silent is None or not confirm:
            return [_node_info(i, rec, now, timeout_s) for i, rec in enumerate(recs)]
        return [_node_info(i, rec, now, timeout_s, silent[i]) for i, rec in enumerate(recs)]

    def _silence(self, recs: list[tuple], timeout_s: float) -> list[bool] | None:
        """Per line: has its sequence stood still across ``need`` of our own beats (True for a
        line that is not LIVE, False for our own), with the counts updated; None when no beat
        loop of ours is running (nothing to count with). ``dead`` = not ``live`` and silent."""
        me = None
        for nid in sorted(self._beating):
            nonce, interval = self._beating.get(nid, (None, 0.0))
            if nid < len(recs) and recs[nid][0] == L.NODE_LIVE and recs[nid][2] == nonce:
                me = (nid, nonce, interval)
                break
        if me is None:
            return None
        my_id, my_nonce, interval = me
        if self._seen_by != (my_id, my_nonce):
            self._seen.clear()
            self._seen_by = (my_id, my_nonce)
        my_seq = recs[my_id][5]
        need = max(CONFIRM_MIN_BEATS, math.ceil(timeout_s / (4 * interval)))
        seen = self._seen
        out: list[bool] = []
        for i, (state, _epoch, nonce, _pid, _hb, seq, _host, _joined) in enumerate(recs):
            if i == my_id:
                out.append(False)
            elif state != L.NODE_LIVE:
                seen.pop(i, None)
                out.append(True)
            else:
                first = seen.get(i)
                if first is None or first[0] != nonce or first[1] != seq:
                    seen[i] = (nonce, seq, my_seq)
                    out.append(False)
                else:
                    out.append(my_seq - first[2] >= need)
        return out

    def live_ids(self, *, timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S) -> list[int]:
        """Ids whose state is LIVE and heartbeat fresh."""
        return [i.node_id for i in self.all(timeout_s=timeout_s) if i.live]

    def is_live(self, node_id: int, *, timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S) -> bool:
        return self.info(node_id, timeout_s=timeout_s).live

    def join(self, node_id: int, *, timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S) -> NodeHandle:
        """Claim ``node_id`` for this process.

        Raises NodeIdOutOfRange, NodeIdInUse (a live process holds it: on this host, by the OFD
        lock; elsewhere, by a fresh heartbeat).
        """
        off = self.line_offset(node_id)
        lock_fd = os.open(self._path, os.O_RDWR)
        try:
            if not ofd_lock(lock_fd, NODE_LOCK_BASE + node_id):
                raise NodeIdInUse(f"node id {node_id} is held by a live process on this host "
                                  f"(pid {self.info(node_id).pid}); pick another node_id")
            cur = self.info(node_id, timeout_s=timeout_s)
            if cur.live:
                raise NodeIdInUse(
                    f"node id {node_id} has a fresh heartbeat ({cur.heartbeat_age_s:.3f} s old, "
                    f"pid {cur.pid}, host {cur.host_id:#x}); pick another node_id or wait "
                    f"{timeout_s} s for it to be judged dead")
        except BaseException:
            os.close(lock_fd)
            raise
        nonce = secrets.randbits(63) | 1
        epoch = cur.epoch + 1
        now = time.time_ns()
        mem = self._view.mem
        K.store(mem, off + _F["epoch"], epoch)
        K.store(mem, off + _F["owner_nonce"], nonce)
        K.store(mem, off + _F["pid"], os.getpid())
        K.store(mem, off + _F["heartbeat_ns"], now)
        K.store(mem, off + _F["heartbeat_seq"], 0)
        K.store(mem, off + _F["host_id"], host_id())
        K.store(mem, off + _F["joined_ns"], now)
        K.flush(mem, off, S_NODE_WRITE)
        K.store_fence(mem)
        K.store_flush(mem, off + _F["state"], L.NODE_LIVE, S_NODE_STATE)
        h = NodeHandle(node_id=int(node_id), epoch=epoch, owner_nonce=nonce, lock_fd=lock_fd)
        self._handles.append(h)
        return h

    def heartbeat(self, handle: NodeHandle) -> None:
        """Stamp this node alive. Raises NodeEvicted if another process took the id over.

        One beat, for callers that drive their own schedule; the engine and
        ``heartbeat_forever`` beat with ``beat_until_stopped`` (no GIL, no event loop)."""
        self._check_owner(handle)
        _stamp(self._view.mem, self.line_offset(handle.node_id))

    def beat_until_stopped(self, handle: NodeHandle, interval_s: float, stop: np.ndarray) -> None:
        """Heartbeat every ``interval_s`` from the calling thread, without the GIL, until
        ``stop[0]`` becomes non-zero (``stop``: a uint64 array the caller keeps alive). Raises
        NodeEvicted when another process took the id over. For a dedicated thread."""
        self._check_owner(handle)
        if stop.dtype != np.uint64 or stop.size < 1:
            raise ValueError("stop must be a uint64 array of at least one element")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._beating[handle.node_id] = (handle.owner_nonce, float(interval_s))
        try:
            rc = _beat_loop(self._view.mem, self.line_offset(handle.node_id),
                            np.uint64(handle.owner_nonce), int(interval_s * 1e9),
                            stop.ctypes.data)
        finally:
            if self._beating.get(handle.node_id, (None,))[0] == handle.owner_nonce:
                del self._beating[handle.node_id]
        if rc != 0:
            self._check_owner(handle)           # raises NodeEvicted with the details
            raise NodeEvicted(f"node {handle.node_id} is no longer LIVE in the node table")

    def _check_owner(self, handle: NodeHandle) -> None:
        if handle.left:
            raise NodeEvicted(f"node {handle.node_id} already left")
        cur = self.info(handle.node_id)
        if cur.owner_nonce != handle.owner_nonce or cur.state != L.NODE_LIVE:
            handle.left = True
            raise NodeEvicted(
                f"node {handle.node_id} was taken over (nonce {cur.owner_nonce:#x} != ours "
                f"{handle.owner_nonce:#x}, state {cur.state_name}): this process must stop "
                f"writing to the region")

    def leave(self, handle: NodeHandle) -> None:
        """Mark the node LEFT and release the id. Idempotent."""
        if handle.left:
            self._release(handle)
            return
        try:
            cur = self.info(handle.node_id)
            if cur.owner_nonce == handle.owner_nonce:
                off = self.line_offset(handle.node_id)
                K.store_flush(self._view.mem, off + _F["state"], L.NODE_LEFT, S_NODE_STATE)
        finally:
            handle.left = True
            self._release(handle)

    def _release(self, handle: NodeHandle) -> None:
        if handle.lock_fd >= 0:
            try:
                ofd_unlock(handle.lock_fd, NODE_LOCK_BASE + handle.node_id)
            finally:
                os.close(handle.lock_fd)
                handle.lock_fd = -1
        if handle in self._handles:
            self._handles.remove(handle)

    def close_mapping(self) -> None:
        """Leave every node this process joined, as the region is unmapped (``Region.close``):
        a damaged region must not make closing fail."""
        for h in list(self._handles):
            try:
                self.leave(h)
            except Exception:  # closing must not fail because the region is damaged
                h.left = True
                self._release(h)
