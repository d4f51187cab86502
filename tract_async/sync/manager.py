"""LockManager: the coroutine that grants the global locks, and its election.

One manager grants at a time. Every engine process runs ``LockManager.run()`` in its TaskGroup;
all of them are *candidates*, and at most one is the *manager* of the current term.

Manager line and terms. The ``MANAGER`` line (``layout.py``) names the manager node, its node
epoch and the term. A manager is *valid* while that node is not dead (``NodeInfo.dead``: a
stale heartbeat that also stood still across several of the reader's own beats) with the same
epoch. Candidates poll the line every ``liveness_timeout_s / 4``.

Election (no atomics: Lamport's bakery over the ``MANAGER_CANDIDATE`` lines, one per node, each
written only by its node). When the manager is missing or invalid, the lowest live candidate
campaigns at once and the others after ``liveness_timeout_s`` more (so the lowest live node
manages by default, and a higher one steps in if it fails to). To campaign: ``choosing = 1``,
flush; ``number = 1 + max(number of live candidates)``, flush; ``choosing = 0``, flush; wait for
every live node ``j`` with ``choosing`` set to finish, and for every live ``j`` with a smaller
``(number, j)`` to leave. Inside that critical section re-read the manager line; only if it is
still missing or invalid write ``manager = me, term + 1``, flush. Then ``number = 0``, flush.
Nodes judged dead are skipped by the bakery (a dead node's ticket would block it forever); that
is safe for the same reason the lease below is. The waiting candidate skips a rival on the
``dead`` verdict (stale, and stood still across several of its own beats), never on a single
stale snapshot (``not live``): after a stall of the waiter's own host every rival looks stale
until the rivals' beat threads have run again, and a live rival in the critical section would
be passed (two candidates in the election at once). The node table reads its clock before
the lines for the same reason (``region/nodes.py``, "Clock first").

Election lapse (model finding A3, issue 36). The bakery skips a rival judged dead. A candidate
paused inside the election (after its ticket, or in the critical section between its re-read
of the manager line and its write) can be judged dead and skipped, and then resume: with its
smaller ticket it does not wait for the rival that skipped it, or it writes the term it decided
on before its pause, and two managers share one term. So a candidate takes a ticket only with
a fresh heartbeat of its own, and watches itself through the election (``_ElectionWatch``):
at every poll of the wait and right before the write it requires its own heartbeat younger
than ``liveness_timeout_s / 2`` and less than ``liveness_timeout_s / 4`` since its previous
step; otherwise it leaves (``number = 0``) without writing and campaigns again at its next
poll. Evidence: ``tests/sync/test_election_pause.py`` (SIGSTOP at ``elect.ticket`` and at
``elect.decided``). What stays is the window between the last check and the store after it.

Dead tickets. A candidate killed inside the election (crash points ``elect.ticket``,
``elect.decided``) leaves ``choosing`` or ``number`` set in its line. The bakery skips a dead
node, so the ticket blocks nobody, but nobody else would ever clear it (fsck: "dead node left
choosing/number set" after the survivors recovered). So the manager clears both words of a dead
node's line between its scan slices, under the same checks as a revocation (its fence deadline,
its own term re-read). The line's other words stay as its node wrote them. A node judged dead
while only paused inside an election leaves it at its next step without writing (election
lapse), so the cleared ticket was not in use; a node that resumes and takes a fresh ticket in
the window between the manager's dead verdict and its store has that ticket cleared -- the
residual window of every check-then-store here.

A live manager is pre-empted only when it stops granting: takeover happens on its death, its
resignation (``run()`` cancelled), or its *stall*. While it manages, a node stamps ``scan_ns``
in its own candidate line at the start of every scan slice (every ~10 ms busy, ~50 ms idle:
``ManagerPolicy.idle_slice_s``). A
manager whose stamp is older than ``liveness_timeout_s`` is invalid even though its node's
heartbeat is fresh (the heartbeat beats from a GIL-free thread; the manager needs its thread to
run Python between slices): a process that starves its manager thread cannot freeze the rack.
(The heartbeat is GIL-free once its thread runs the jitted beat loop; the engine loads that
kernel, and every other, before it joins, ``kernel_cache.ensure_warm``: a Numba compile after the
join held the GIL and the compiler lock for seconds, and the cold demo's manager stepped down.)

Stall lease. A manager that finds its own last stamp older than ``liveness_timeout_s / 2`` when
it resumes steps down without granting (its term may be being taken), and its fencing deadline
is the earlier of heartbeat + half and stamp + half: it never grants once its stamp is half a
timeout old, and others elect only once it is a whole timeout old -- the same margin as the
heartbeat lease below. A stepped-down node follows like any candidate (and, as the lowest live
one, may win the next term at once).

Lease (why two managers never grant at once). Before *every* grant, release or revocation the
manager (1) checks its own lease: its node's last heartbeat is younger than
``liveness_timeout_s / 2`` by its own clock, and (2) re-reads the manager line and finds its own
term. Others elect a new manager only after its heartbeat is older than ``liveness_timeout_s``
(and stood still across several of their own beats: ``NodeInfo.dead``), by which time the old
manager has stopped writing for ``liveness_timeout_s / 2``. Residual window: a manager thread
that passed both checks and then stalls for more than half the liveness timeout before its next
store (a store that is already in flight when it resumes). Heartbeats must come at least every
``liveness_timeout_s / 4`` (``liveness.heartbeat_forever``), and clocks of the rack agree within
a small fraction of the timeout (NTP/PTP), as for node liveness.

Takeover. The new manager reads every ``LOCK_STATE`` and ``LOCK_GRANT`` line fresh. A holder
named in a state line keeps the lock (and its token); if its grant line lags the state line (the
old manager died between the two stores) the grant is re-issued with the recorded token. New
tokens are ``term << 32 | n``: larger than any token of an older term.

Holder death. Between scan slices the manager reads the node table; a holder whose node is
dead (``NodeInfo.dead``) is revoked: ``holder = 0``, ``revocations += 1``,
``last_revoked_token = token``, flush. Its request stays recorded as granted, so it is never
granted again; a new process of that node withdraws it before requesting
(``slots.post_request``).

Polling. The scan runs in a worker thread (``manager_slice``, nogil) for ``slice_s`` at a time:
``sched_yield`` between scans while the lock saw a request or release within ``spin_s`` (while
yields are cheap: ``tract_kernels.yielding``), then
``usleep`` doubling to ``sleep_us_max``; idle for ``bell.BELL_AFTER_S``, it sleeps on its bell
between scans (``sync/bell.py``: a same-host requester rings it, anyone else is seen within
``BELL_WAIT_MS``). Busy, it yields the core to waiters on every scan (never busy-poll with more
pollers than cores).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

import tract_kernels as K
from tract_kernels.yielding import STATE as YIELD_STATE

from .. import crashpoints as CP
from ..errors import NodeEvicted
from ..region import layout as L
from ..region.nodes import DEFAULT_LIVENESS_TIMEOUT_S, NodeInfo, all_on_host
from . import slots as S
from .bell import BELL_AFTER_S, BELL_WAIT_MS, LOCAL_BELL_WAIT_MS, ManagerBell
from .lock import run_slice
from .manager_line import (CAND_EPOCH, CANDIDATE, CHOOSING, NUMBER, S_CAND_READ, SCAN_NS,
                           ManagerInfo, manager_valid, read_manager, read_scan_ns)

log = logging.getLogger(__name__)

S_CAND_FLUSH = K.site("lock.election.candidate.flush")
S_MGR_FLUSH = K.site("lock.election.manager.flush")


@dataclass(frozen=True, kw_only=True)
class ManagerPolicy:
    """Polling policy of the manager (see the module docstring)."""
    spin_s: float = 0.002
    sleep_us_max: int = 500
    slice_s: float = 0.01
    idle_slice_s: float = 0.05
    """A slice's length when it starts with the manager asleep on its bell and no lock held
    (at most ``liveness_timeout_s / 16``): the Python between slices (the scan stamp, the node
    table, revocations) was ~1.1 % of a core at 100 slices a second in an idle engine on the
    2-core VM. Grants inside the slice are not delayed by it; the scan stamp is."""


@dataclass(frozen=True, kw_only=True)
class ManagerStatistics:
    is_manager: bool
    term: int | None
    terms_won: int
    grants: int
    revocations: int
    slices: int
    step_downs: int
    self_fenced: int
    stalls: int
    """Terms given up because this manager's own scans had stalled (stall lease)."""
    bell_sleeps: int = 0
    """Sleeps on the bell while idle (``sync/bell.py``), rung or timed out."""
    bell_rings: int = 0
    """Of those, the ones a ring ended."""


class _ElectionWatch:
    """A candidate's own liveness through one election (module docstring, "Election lapse").

    ``ok`` is called at the doorway, at every poll of the bakery wait and last right before the
    new term is written. It fails when this candidate's own heartbeat is ``liveness_timeout_s /
    2`` old or more, or when ``liveness_timeout_s / 4`` or more passed since the previous call
    (the manager's loop polls every millisecond: a gap that long is a pause or a starved
    thread). Between two passing calls the heartbeat's age stays below 3/4 of the timeout, so
    no rival can have judged this candidate dead (older than the whole timeout) and skipped its
    ticket meanwhile."""

    def __init__(self, mgr: "LockManager") -> None:
        self._mgr = mgr
        self._t = time.monotonic()

    def ok(self, where: str) -> bool:
        mgr = self._mgr
        now = time.monotonic()
        gap, self._t = now - self._t, now
        age = mgr._region.nodes.info(mgr.node_id, timeout_s=mgr.liveness_timeout_s
                                     ).heartbeat_age_s
        t = mgr.liveness_timeout_s
        if gap < t / 4 and age < t / 2:
            return True
        mgr.lapses += 1
        log.warning("lock manager node %d: election left at the %s without a write: %.3f s "
                    "since its previous step, own heartbeat %.3f s old (liveness timeout "
                    "%.3f s): it may have been judged dead and skipped meanwhile", mgr.node_id,
                    where, gap, age, t)
        return False


class LockManager:
    """Candidate for, and while elected the manager of, every global lock of ``region``.

    Run ``await manager.run()`` as a task of the engine's TaskGroup: it never returns; cancel it
    to stop (a manager resigns its term on the way out). One LockManager per node.
    """

    def __init__(self, region, node_handle, *,  # noqa: ANN001
                 liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
                 policy: ManagerPolicy = ManagerPolicy()) -> None:
        self._region = region
        self._handle = node_handle
        self._geo = S.geometry(region)
        self._mem = S.private_view(region, 5000 + int(node_handle.node_id))
        self.node_id = int(node_handle.node_id)
        self.liveness_timeout_s = float(liveness_timeout_s)
        self.policy = policy
        n, nl = self._geo.max_nodes, self._geo.num_locks
        self._st = np.zeros((nl, S.M_COLS), dtype=np.int64)
        self._granted = np.zeros((nl, n), dtype=np.int64)
        self._live = np.zeros(n, dtype=np.uint8)
        self._term: int | None = None
        self._idle_ns = 0
        self._terms_won = self._slices = self._step_downs = self._self_fenced = 0
        self._stalls = 0
        self._revocations = 0
        self._grants_at_start = 0
        self._last_scan_ns = 0
        self._bell = ManagerBell(region)
        self._bell_buf = np.zeros(64, dtype=np.uint8)
        self._bell_stats = np.zeros(2, dtype=np.int64)      # sleeps on the bell, rings heard
        self.use_bell = True
        """Sleep on the bell when idle (``sync/bell.py``); False: poll every ``sleep_us_max``
        whatever the idle time (the bell's tests compare the two)."""
        self.elected = threading.Event()
        """Set while this node manages (a threading.Event: the manager may run on its own
        thread and loop, ``ManagerThread``)."""
        self.stall_hook: Callable[[], None] | None = None
        """Test seam: called on the manager's thread before each slice (a test stalls it)."""
        self.terms: list[int] = []
        """Every term this node won, in order (tests check that no term has two winners)."""
        self.lapses = 0
        """Elections left without a write because this candidate paused inside them."""
        self.tickets_cleared = 0
        """Dead nodes' election tickets this node cleared while managing ("Dead tickets")."""
        self.stall_lease = True
        """Step down after a stall of the own scans, and fence grants at stamp + half (module
        docstring). Only the site-removal test of the term re-read turns it off: with it on, a
        resumed zombie steps down before it ever reaches that re-read, so the re-read (defence
        against clock skew between nodes) can only be shown necessary without it."""

    # -- public -------------------------------------------------------------------------------
    @property
    def is_manager(self) -> bool:
        return self._term is not None

    async def run(self) -> None:
        """Campaign, manage while elected, follow otherwise. Endless; cancel to stop."""
        self._write_candidate(candidate=1, choosing=0, number=0)
        try:
            while True:
                if self._term is None:
                    await self._follow()
                else:
                    await self._manage()
        finally:
            try:
                if self._term is not None:
                    self._resign()
            finally:
                self._write_candidate(candidate=0, choosing=0, number=0)

    def statistics(self) -> ManagerStatistics:
        return ManagerStatistics(
            is_manager=self.is_manager, term=self._term, terms_won=self._terms_won,
            grants=int(self._st[:, S.M_GRANTS].sum()) - self._grants_at_start,
            revocations=self._revocations, slices=self._slices, step_downs=self._step_downs,
            self_fenced=self._self_fenced, stalls=self._stalls,
            bell_sleeps=int(self._bell_stats[0]), bell_rings=int(self._bell_stats[1]))

    # -- candidate lines ----------------------------------------------------------------------
    def _write_candidate(self, *, candidate: int, choosing: int, number: int) -> None:
        m, off = self._mem, self._geo.cand_off(self.node_id)
        K.store(m, off + CHOOSING, choosing)
        K.store(m, off + NUMBER, number)
        K.store(m, off + CANDIDATE, candidate)
        K.store(m, off + CAND_EPOCH, self._handle.epoch)
        K.flush(m, off, S_CAND_FLUSH)
        K.full_fence(m)

    def _read_candidate(self, node_id: int) -> tuple[int, int, int]:
        m, off = self._mem, self._geo.cand_off(node_id)
        choosing = int(K.load_fresh(m, off + CHOOSING, S_CAND_READ))
        return choosing, int(K.load(m, off + NUMBER)), int(K.load(m, off + CANDIDATE))

    def _stamp_scan(self) -> int:
        """Store now into this node's ``scan_ns`` (own candidate line), flush; returns it."""
        now = time.time_ns()
        K.store_flush(self._mem, self._geo.cand_off(self.node_id) + SCAN_NS, now, S_CAND_FLUSH)
        self._last_scan_ns = now
        return now

    def _nodes(self) -> list[NodeInfo]:
        return self._region.nodes.all(timeout_s=self.liveness_timeout_s)

    def _all_can_ring(self, nodes: list[NodeInfo], me: NodeInfo) -> bool:
        """Every LIVE node that is not dead (the ones whose requests the scan grants) runs on
        this host, so its requests ring the bell (``sync/bell.py``, "Everyone local")."""
        return all_on_host(nodes, me.host_id, stale_too=True)

    def _valid(self, info: ManagerInfo, nodes: list[NodeInfo]) -> bool:
        """``manager_valid`` including the manager's stall stamp."""
        if info.node_id is None or info.node_id >= len(nodes):
            return False
        return manager_valid(info, nodes, scan_ns=read_scan_ns(self._region, info.node_id,
                                                               self._geo, self._mem),
                             timeout_s=self.liveness_timeout_s)

    # -- follower -----------------------------------------------------------------------------
    async def _follow(self) -> None:
        poll = self.liveness_timeout_s / 4
        missing_since: float | None = None
        while True:
            nodes = self._nodes()
            info = read_manager(self._region, self._geo, self._mem)
            if self._valid(info, nodes):
                missing_since = None
            else:
                now = time.monotonic()
                if missing_since is None:
                    missing_since = now
                lower = [j for j in range(self.node_id) if not nodes[j].dead
                         and self._read_candidate(j)[2] == 1]
                if not lower or now - missing_since > self.liveness_timeout_s:
                    if await self._elect():
                        return
            await asyncio.sleep(poll)

    async def _elect(self) -> bool:
        """One bakery round; True when this node won a new term (module docstring,
        "Election lapse": False without a write when this candidate paused inside it)."""
        me = self.node_id
        watch = _ElectionWatch(self)
        if not watch.ok("doorway"):       # a ticket only with a fresh heartbeat of its own
            return False
        self._write_candidate(candidate=1, choosing=1, number=0)
        nodes = self._nodes()
        top = 0
        for j in range(self._geo.max_nodes):
            if j != me and not nodes[j].dead:
                top = max(top, self._read_candidate(j)[1])
        mine = top + 1
        self._write_candidate(candidate=1, choosing=1, number=mine)
        self._write_candidate(candidate=1, choosing=0, number=mine)
        if CP.ARMED:
            CP.hit("elect.ticket")
        try:
            for j in range(self._geo.max_nodes):
                if j == me:
                    continue
                while True:
                    if not watch.ok("bakery"):
                        return False
                    # the whole table (not ``_nodes``: the same read, but tests observe that
                    # call as the start of the critical section): ``dead`` is counted over it
                    if self._region.nodes.all(timeout_s=self.liveness_timeout_s)[j].dead:
                        break
                    choosing, number, _ = self._read_candidate(j)
                    if choosing:
                        await asyncio.sleep(0.001)
                        continue
                    if number != 0 and (number, j) < (mine, me):
                        await asyncio.sleep(0.001)
                        continue
                    break
            # critical section of the election
            nodes = self._nodes()
            info = read_manager(self._region, self._geo, self._mem)
            if self._valid(info, nodes) or not nodes[me].live:
                return False
            if CP.ARMED:
                CP.hit("elect.decided")
            if not watch.ok("critical section"):   # the last check before the write
                return False
            term = info.term + 1
            self._stamp_scan()     # before the line that makes it manager: never seen stale
            m, off = self._mem, self._geo.manager_offset
            K.store(m, off + S.MGR_MANAGER, me + 1)
            K.store(m, off + S.MGR_TERM, term)
            K.store(m, off + S.MGR_EPOCH, self._handle.epoch)
            K.store(m, off + S.MGR_SINCE, time.time_ns())
            K.flush(m, off, S_MGR_FLUSH)
            K.full_fence(m)
        finally:
            self._write_candidate(candidate=1, choosing=0, number=0)
        self._take_over(term)
        return True

    def _take_over(self, term: int) -> None:
        self.terms.append(term)
        if CP.ARMED:
            CP.hit("manager.takeover")
        m, geo = self._mem, self._geo
        raw = np.zeros(64, dtype=np.uint8)
        for lk in range(geo.num_locks):
            K.read_bytes(m, geo.state_off(lk), raw.ctypes.data, 64, S.S_M_TAKEOVER_READ)
            rec = raw.view(L.LOCK_STATE.dtype)[0]
            st = self._st[lk]
            st[S.M_HOLDER] = int(rec["holder"]) - 1
            st[S.M_HOLDER_REQ] = int(rec["holder_req"])
            st[S.M_TOKEN] = int(rec["token"])
            st[S.M_SEQ] = 0
            st[S.M_GRANTS] = int(rec["grants"])
            st[S.M_REVOKED] = int(rec["revocations"])
            st[S.M_LAST_REVOKED] = int(rec["last_revoked_token"])
            st[S.M_RR] = int(rec["rr_cursor"]) % geo.max_nodes
            for j in range(geo.max_nodes):
                self._granted[lk, j] = int(S.read_word_fresh(m, geo.grant_off(lk, j) + S.GRANT_SEQ,
                                                             S.S_M_TAKEOVER_READ))
            h = int(st[S.M_HOLDER])
            if h >= 0 and self._granted[lk, h] < st[S.M_HOLDER_REQ]:
                # the old manager died between the state line and the grant line: finish it
                S.write_grant(m, geo.grant_off(lk, h), int(st[S.M_HOLDER_REQ]),
                              int(st[S.M_TOKEN]), term)
                self._granted[lk, h] = st[S.M_HOLDER_REQ]
        self._term = term
        self._terms_won += 1
        self._grants_at_start = int(self._st[:, S.M_GRANTS].sum())
        self._idle_ns = 0
        self.elected.set()

    def _resign(self) -> None:
        info = read_manager(self._region, self._geo, self._mem)
        if info.node_id == self.node_id and info.term == self._term:
            K.store_flush(self._mem, self._geo.manager_offset + S.MGR_MANAGER, 0,
                          S_MGR_FLUSH)
        self._term = None
        self.elected.clear()

    def _step_down(self) -> None:
        self._term = None
        self._step_downs += 1
        self.elected.clear()

    # -- manager ------------------------------------------------------------------------------
    async def _manage(self) -> None:
        """Manage while elected; the bell (``sync/bell.py``) is bound for the term's length."""
        bell_fd = self._bell.open() if self.use_bell else -1
        try:
            await self._manage_term(bell_fd)
        finally:
            self._bell.close()      # every slice that reads it has returned (run_slice waits)

    async def _manage_term(self, bell_fd: int) -> None:
        loop = asyncio.get_running_loop()
        geo, pol = self._geo, self.policy
        half_ns = int(self.liveness_timeout_s / 2 * 1e9)
        bell_after_ns = int(BELL_AFTER_S * 1e9)
        busy_ns = int(pol.slice_s * 1e9)
        idle_ns = int(min(pol.idle_slice_s, self.liveness_timeout_s / 16) * 1e9)
        holders = self._st[:, S.M_HOLDER]
        while self._term is not None:
            if self.stall_hook is not None:
                self.stall_hook()
            now = time.time_ns()
            if self.stall_lease and now - self._last_scan_ns > half_ns:
                # this thread stalled (a starved GIL, a stopped thread): others may be electing
                # already, so give the term up without another grant (stall lease, docstring)
                log.warning("lock manager node %d term %d: own scans stalled %.3f s (liveness "
                            "timeout %.3f s): stepping down", self.node_id, self._term,
                            (now - self._last_scan_ns) / 1e9, self.liveness_timeout_s)
                self._stalls += 1
                self._step_down()
                return
            stamp = self._stamp_scan()
            nodes = self._nodes()
            me = nodes[self.node_id]
            if me.owner_nonce != self._handle.owner_nonce:
                self._step_down()
                raise NodeEvicted(f"node {self.node_id} was taken over; its LockManager stops")
            fence_deadline = (min(me.heartbeat_ns, stamp) if self.stall_lease
                              else me.heartbeat_ns) + half_ns
            for j, n in enumerate(nodes):
                self._live[j] = 0 if n.dead else 1
            self._revoke_dead(nodes, fence_deadline)
            if self._term is None:
                return
            self._clear_dead_tickets(nodes, fence_deadline)
            if self._term is None:
                return
            # every node that may request can ring: the idle scan sleeps on the bell up to the
            # slice's end; else at most BELL_WAIT_MS (another host's request is seen no later)
            bell_ms = LOCAL_BELL_WAIT_MS if self._all_can_ring(nodes, me) else BELL_WAIT_MS
            rc, idle = await run_slice(
                loop, S.manager_slice, self._mem, geo.locks_offset, geo.manager_offset,
                geo.num_locks, geo.max_nodes, self._live, self._st, self._granted, self.node_id,
                self._term, fence_deadline,
                idle_ns if self._idle_ns >= bell_after_ns and (holders < 0).all() else busy_ns,
                int(pol.spin_s * 1e9),
                pol.sleep_us_max, self._idle_ns, bell_fd, bell_after_ns, bell_ms,
                self._bell_buf.ctypes.data, self._bell_stats, YIELD_STATE)
            self._slices += 1
            self._idle_ns = int(idle)
            if CP.ARMED and rc > 0:
                CP.hit("manager.granted")
            if rc == S.SLICE_LOST_TERM:
                self._step_down()
                return
            if rc == S.SLICE_SELF_FENCED:
                self._self_fenced += 1
                await asyncio.sleep(min(0.01, self.liveness_timeout_s / 20))

    def _clear_dead_tickets(self, nodes: list[NodeInfo], fence_deadline: int) -> None:
        """Clear ``choosing`` and ``number`` in the candidate line of every dead node that left
        them set (module docstring, "Dead tickets")."""
        m, geo = self._mem, self._geo
        for j, n in enumerate(nodes):
            if j == self.node_id or not n.dead:
                continue
            off = geo.cand_off(j)
            if not (int(K.load_fresh(m, off + CHOOSING, S_CAND_READ))
                    or int(K.load(m, off + NUMBER))):
                continue
            if time.time_ns() >= fence_deadline:
                return
            info = read_manager(self._region, geo, m)
            if info.node_id != self.node_id or info.term != self._term:
                self._step_down()
                return
            K.store(m, off + CHOOSING, 0)
            K.store(m, off + NUMBER, 0)
            K.flush(m, off, S_CAND_FLUSH)
            K.full_fence(m)
            self.tickets_cleared += 1
            log.info("lock manager node %d term %d: cleared dead node %d's election ticket "
                     "(heartbeat %.3f s old)", self.node_id, self._term, j, n.heartbeat_age_s)

    def _revoke_dead(self, nodes: list[NodeInfo], fence_deadline: int) -> None:
        m, geo = self._mem, self._geo
        for lk in range(geo.num_locks):
            h = int(self._st[lk, S.M_HOLDER])
            if h < 0 or not nodes[h].dead:
                continue
            if time.time_ns() >= fence_deadline:
                return
            info = read_manager(self._region, geo, self._mem)
            if info.node_id != self.node_id or info.term != self._term:
                self._step_down()
                return
            st = self._st[lk]
            n = nodes[h]
            log.warning("lock %d: revoking node %d's token %#x (node %s, heartbeat %.3f s old, "
                        "seq %d; liveness timeout %.3f s; manager node %d term %d)", lk, h,
                        int(st[S.M_TOKEN]), n.state_name, n.heartbeat_age_s, n.heartbeat_seq,
                        self.liveness_timeout_s, self.node_id, self._term)
            st[S.M_HOLDER] = -1
            st[S.M_REVOKED] += 1
            st[S.M_LAST_REVOKED] = st[S.M_TOKEN]
            S.write_state(m, geo.state_off(lk), st, self._term)
            self._revocations += 1
