"""The global-lock slot protocol on region words: the small jitted pieces both sides run.

This module is the on-memory half of the lock; ``lock.py`` (waiters) and ``manager.py`` (the
lock-manager coroutine) are the asyncio halves. No asyncio here.

Lines and writers (tables in ``region/layout.py``; docs/design.md invariant 2):

* ``LOCK_REQ[l, j]`` is written only by node ``j`` (by whichever of its processes holds the
  node-local tier, ``local.py``). A request is ``req_seq += 1``; a release or withdrawal is
  ``rel_seq = req_seq``. The paper's states fall out of the counters: **I** while
  ``rel_seq == req_seq``, **W** while ``req_seq > rel_seq`` and the grant line shows an older
  ``grant_seq``, **L** while ``grant_seq == req_seq > rel_seq``.
* ``LOCK_GRANT[l, j]`` and ``LOCK_STATE[l]`` are written only by the manager of the current term.
  Splitting the request and grant lines (instead of one I/W/L word that both sides write) means
  no line ever has two writers, so no hand-off argument is needed and a whole-line write-back
  can never lose the other party's update. Sequence numbers instead of states also remove the
  ABA of "released and re-requested before the manager looked".

Publish order of a grant (manager): ``LOCK_STATE`` (holder_req, token, ..., and ``holder`` last)
stored, flushed, fenced; *then* ``LOCK_GRANT[l, j]`` stored, flushed, fenced. So whoever sees the grant also finds
the state that names its token, and a manager that dies between the two leaves a state line that
its successor completes (``manager.py``). Release (holder): every write of the critical section
flushed by its writer, then ``rel_seq = req_seq`` stored, flushed, fenced.

Fencing tokens: ``token = term << 32 | n`` with ``n`` counting grants within a term, so tokens
grow across manager takeovers without the new manager having to read every old grant. A holder
proves it still holds the lock by ``check_token``: invalidate ``LOCK_STATE[l]`` and compare
``holder`` and ``token`` with its own; an engine's lock also requires its own heartbeat younger
than half the liveness timeout (``check_token_leased``, the holder lease). The manager revokes a holder whose heartbeat is stale by
clearing ``holder`` and recording ``last_revoked_token`` in that line; the next ``check_token`` of
the revoked process fails, and structure changes journaled under its token are rolled back by the
next holder (``region/chunks.py``). Residual window: a process that passed ``check_token`` and then
stalls longer than the liveness timeout before its next store can still land that store after the
revocation; every metadata write batch therefore re-checks before each of its steps
(``region/chunks.py``, "Fenced steps"), and the journal makes the batch undoable. The window
cannot be closed on memory without atomics or device-side fencing; it is bounded by one step
of a batch (one store group), not by the batch or the hold time.

Polling: every wait loop here has a deadline (``monotonic_ns``) and a spin phase that calls
``sched_yield`` between polls (``tract_kernels.yielding.polite_yield``: only while yields are
cheap; beside a busy task the spin sleeps instead), then sleeps with ``usleep`` growing up to a
cap; the caller passes the process's yield state (``tract_kernels.yielding.STATE``) and runs it
in a worker thread (these functions are ``nogil``), so a waiting process neither burns a core nor
blocks its event loop (measured policy: ``/work/shared/notes/numba-shm-spike.md`` section 3).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

import tract_kernels as K
from tract_kernels.intrinsics import fd_read, fd_wait_readable, monotonic_ns, realtime_ns, usleep
from tract_kernels.yielding import polite_yield

from ..region import layout as L

# waiter side
S_REQ_RELOAD = K.site("lock.request.reload.invalidate")
S_REQ_FLUSH = K.site("lock.request.flush")
S_GRANT_READ = K.site("lock.grant.invalidate")
S_REL_FLUSH = K.site("lock.release.flush")
S_STATE_READ = K.site("lock.state.invalidate")
S_LEASE_READ = K.site("lock.lease.heartbeat.invalidate")
# manager side
S_M_REQ_READ = K.site("lock.manager.request.invalidate")
S_M_STATE_FLUSH = K.site("lock.manager.state.flush")
S_M_GRANT_FLUSH = K.site("lock.manager.grant.flush")
S_M_TERM_READ = K.site("lock.manager.term.invalidate")
S_M_TAKEOVER_READ = K.site("lock.manager.takeover.invalidate")

_REQ = {n: L.LOCK_REQ.dtype.fields[n][1] for n in ("req_seq", "rel_seq", "epoch", "requested_ns")}
_GRANT = {n: L.LOCK_GRANT.dtype.fields[n][1]
          for n in ("grant_seq", "token", "term", "granted_ns", "check")}
_STATE = {n: L.LOCK_STATE.dtype.fields[n][1] for n in L.LOCK_STATE.dtype.names if n != "pad"}
_MGR = {n: L.MANAGER.dtype.fields[n][1] for n in ("manager", "term", "epoch", "since_ns")}

# word offsets as plain ints (frozen into the jitted code)
REQ_SEQ, REL_SEQ, REQ_EPOCH, REQ_NS = 0, 8, 16, 24
GRANT_SEQ, GRANT_TOKEN, GRANT_TERM, GRANT_NS, GRANT_CHECK = 0, 8, 16, 24, 32
ST_HOLDER, ST_HOLDER_REQ, ST_TOKEN, ST_TERM, ST_GRANTS, ST_REVOKED, ST_LAST_REVOKED, ST_RR = (
    0, 8, 16, 24, 32, 40, 48, 56)
MGR_MANAGER, MGR_TERM, MGR_EPOCH, MGR_SINCE = 0, 8, 16, 24
assert (_REQ["req_seq"], _REQ["rel_seq"], _REQ["epoch"], _REQ["requested_ns"]) == (0, 8, 16, 24)
assert (_GRANT["grant_seq"], _GRANT["token"], _GRANT["term"], _GRANT["granted_ns"],
        _GRANT["check"]) == (0, 8, 16, 24, 32)
assert [_STATE[n] for n in ("holder", "holder_req", "token", "term", "grants", "revocations",
                            "last_revoked_token", "rr_cursor")] == [0, 8, 16, 24, 32, 40, 48, 56]
assert (_MGR["manager"], _MGR["term"], _MGR["epoch"], _MGR["since_ns"]) == (0, 8, 16, 24)

LOCKS_SECTION = "sync.locks"
MANAGER_SECTION = "sync.manager"
TOKEN_TERM_SHIFT = 32

# columns of the manager's private per-lock state array (int64[nlocks, M_COLS])
M_HOLDER, M_HOLDER_REQ, M_TOKEN, M_SEQ, M_GRANTS, M_REVOKED, M_LAST_REVOKED, M_RR = range(8)
M_COLS = 8

# return codes of manager_slice
SLICE_LOST_TERM = -1
SLICE_SELF_FENCED = -2


class LockGeometry(NamedTuple):
    """Where the lock lines of one region are (all offsets in bytes from the region base)."""
    locks_offset: int
    manager_offset: int
    num_locks: int
    max_nodes: int

    def state_off(self, lock_index: int) -> int:
        return self.locks_offset + lock_index * (1 + 2 * self.max_nodes) * L.LINE_BYTES

    def req_off(self, lock_index: int, node_id: int) -> int:
        return self.state_off(lock_index) + (1 + node_id) * L.LINE_BYTES

    def grant_off(self, lock_index: int, node_id: int) -> int:
        return self.state_off(lock_index) + (1 + self.max_nodes + node_id) * L.LINE_BYTES

    def cand_off(self, node_id: int) -> int:
        return self.manager_offset + (1 + node_id) * L.LINE_BYTES


def locks_bytes(num_locks: int, max_nodes: int) -> int:
    """Bytes of the ``sync.locks`` section."""
    return num_locks * (1 + 2 * max_nodes) * L.LINE_BYTES


def manager_bytes(max_nodes: int) -> int:
    """Bytes of the ``sync.manager`` section."""
    return (1 + max_nodes) * L.LINE_BYTES


def geometry(region) -> LockGeometry:  # noqa: ANN001 (Region; avoids an import cycle)
    """The lock geometry of ``region``. Raises RootNameNotFound if it has no lock sections."""
    locks = region.section(LOCKS_SECTION)
    mgr = region.section(MANAGER_SECTION)
    n = region.max_nodes
    num_locks = locks.nbytes // ((1 + 2 * n) * L.LINE_BYTES)
    # the section sizes are region words: a damaged root directory must not make the lock
    # protocol (or fsck) address lines past its sections
    if num_locks < 1 or mgr.nbytes < manager_bytes(n):
        from ..errors import RegionCorrupt
        raise RegionCorrupt(f"{region.path}: lock sections {LOCKS_SECTION} ({locks.nbytes} bytes) "
                            f"or {MANAGER_SECTION} ({mgr.nbytes} bytes) are too small for {n} "
                            f"nodes: the root directory is damaged")
    return LockGeometry(locks.offset_bytes, mgr.offset_bytes, int(num_locks), int(n))


def private_view(region, salt: int) -> K.Mem:  # noqa: ANN001
    """The Mem a lock object or a manager uses: the region's own on real hardware; on the sim
    backend a separate private cache (same eviction rate, same skipped site).

    The sim's cache arrays are not thread-safe, and the lock polls from worker threads while the
    event loop may touch the region through ``region.mem``; a separate simulated cache is also
    the stricter model (it treats the two users as incoherent even on one host).
    """
    m = region.mem
    if m[K.MEM_BACKEND] != K.BACKEND_SIM:
        return m
    return region.private_mem((salt * 7919 + int(K.mem_state(m).ctl[0])) & 0x7FFFFFFF or 1)


# ---------------------------------------------------------------------------------------------
# waiter side


@njit(cache=True, nogil=True)
def post_request(m, req_off, epoch):
    """Post W: finish any request an earlier process of this node left open, then request.

    Returns the new ``req_seq``. The caller holds the node-local tier, so it is the line's only
    writer. Publish order: requested_ns, epoch, rel_seq, req_seq stored, then one flush + fence
    (one line, so the manager sees either the old or the new request, never a mix).
    """
    req = K.load_fresh(m, req_off + REQ_SEQ, S_REQ_RELOAD)
    rel = K.load(m, req_off + REL_SEQ)
    if rel < req:  # a crashed process of this node left W or L behind: withdraw it first
        rel = req
    K.store(m, req_off + REQ_EPOCH, epoch)
    K.store(m, req_off + REQ_NS, realtime_ns())
    K.store(m, req_off + REL_SEQ, rel)
    K.store(m, req_off + REQ_SEQ, req + np.uint64(1))
    K.flush(m, req_off, S_REQ_FLUSH)
    K.full_fence(m)
    return req + np.uint64(1)


GRANT_MIX = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True, forceinline=True)
def grant_check(req, token):
    """The grant line's check word. Multiplying by an odd constant is a bijection, so a read that
    pairs a grant's ``grant_seq`` with another grant's token or check word fails it."""
    return np.uint64(token) ^ (np.uint64(req) * GRANT_MIX)


@njit(cache=True, nogil=True)
def poll_grant(m, grant_off, req):
    """One poll: the grant's token when ``grant_seq == req``, else 0.

    The line is read whole and its check word compared: ``grant_seq`` is stored last, but a line
    can reach memory, or be filled from it, word by word in address order (the incoherent
    backend does both), so the new ``grant_seq`` can be read beside the *previous* grant's
    token. A waiter that took that token held the lock under a stale token and was refused as
    revoked at its first ``check_token``. A torn read fails the check and the next poll (fresh
    again) reads the settled line."""
    g = K.load_fresh(m, grant_off + GRANT_SEQ, S_GRANT_READ)
    if g == req:
        tok = K.load(m, grant_off + GRANT_TOKEN)
        if K.load(m, grant_off + GRANT_CHECK) == grant_check(req, tok):
            return tok
    return np.uint64(0)


@njit(cache=True, nogil=True)
def wait_grant(m, grant_off, req, budget_ns, spin_ns, sleep_us_max, yield_state):
    """Poll for the grant of ``req`` for at most ``budget_ns``: token, or 0 at the deadline.

    Spins with ``sched_yield`` for ``spin_ns`` (``polite_yield`` with ``yield_state``: sleeps
    instead while yields are slow), then sleeps with ``usleep`` doubling up to
    ``sleep_us_max``. Runs without the GIL (call it from a worker thread).
    """
    start = monotonic_ns()
    sleep_us = 1
    while True:
        tok = poll_grant(m, grant_off, req)
        if tok != 0:
            return tok
        now = monotonic_ns()
        if now - start >= budget_ns:
            return np.uint64(0)
        if not (now - start < spin_ns and polite_yield(yield_state, now)):
            usleep(sleep_us)
            sleep_us = min(sleep_us * 2, sleep_us_max)


@njit(cache=True, nogil=True)
def release(m, req_off, req):
    """Post I for request ``req`` (a release, or the withdrawal of an ungranted request)."""
    K.store(m, req_off + REL_SEQ, req)
    K.flush(m, req_off, S_REL_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def check_token(m, state_off, node_id, token):
    """True while ``LOCK_STATE`` still names this node and token as the holder (fencing)."""
    holder = K.load_fresh(m, state_off + ST_HOLDER, S_STATE_READ)
    cur = K.load(m, state_off + ST_TOKEN)
    return holder == np.uint64(node_id + 1) and cur == token


#: ``check_token_leased`` results.
TOKEN_OK, TOKEN_REVOKED, LEASE_LAPSED = 0, 1, 2


@njit(cache=True, nogil=True)
def check_token_leased(m, state_off, node_id, token, beat_off, lease_ns):
    """``check_token`` plus the holder's lease (model finding A2, ``FIX_HOLDER_LEASE``): the
    node's own ``heartbeat_ns`` (the word at ``beat_off``, CLOCK_REALTIME) must be younger than
    ``lease_ns``. Returns TOKEN_OK, TOKEN_REVOKED or LEASE_LAPSED (``lease_ns`` <= 0: no lease).

    Why: a holder resumed from a pause can pass ``check_token`` while a revocation the manager
    decided during the pause is still in flight (the state line names it until that store
    lands), and its write lands after the revocation. The manager revokes only a node whose
    heartbeat is a whole liveness timeout old; a holder that writes only while its own heartbeat
    is younger than half of it cannot be that node, unless it pauses between this check and its
    store (the residual window A1)."""
    if not check_token(m, state_off, node_id, token):
        return TOKEN_REVOKED
    if lease_ns > 0:
        beat = np.int64(K.load_fresh(m, beat_off, S_LEASE_READ))
        if beat == 0 or np.int64(realtime_ns()) - beat >= lease_ns:
            return LEASE_LAPSED
    return TOKEN_OK


# ---------------------------------------------------------------------------------------------
# manager side


@njit(cache=True, nogil=True)
def write_state(m, state_off, st, term):
    """Publish the manager's private state of one lock (one line, one flush).

    ``holder`` is stored last. The line can be written back early, between two stores, and a
    manager that dies before its flush leaves that prefix in memory for its successor's
    ``_take_over``. With ``holder`` first, the prefix named the new holder next to the previous
    grant's ``holder_req`` and ``token``; the successor re-issued that grant, and the new holder
    passed ``check_token`` with a token an earlier holder had used (model/lock.pml,
    ``MUT_HOLDER_FIRST``). With ``holder`` last, a prefix of a grant names no holder, and
    releases and revocations change only ``holder``.
    """
    holder = st[M_HOLDER]
    K.store(m, state_off + ST_HOLDER_REQ, st[M_HOLDER_REQ])
    K.store(m, state_off + ST_TOKEN, st[M_TOKEN])
    K.store(m, state_off + ST_TERM, term)
    K.store(m, state_off + ST_GRANTS, st[M_GRANTS])
    K.store(m, state_off + ST_REVOKED, st[M_REVOKED])
    K.store(m, state_off + ST_LAST_REVOKED, st[M_LAST_REVOKED])
    K.store(m, state_off + ST_RR, st[M_RR])
    K.store(m, state_off + ST_HOLDER, holder + 1 if holder >= 0 else 0)
    K.flush(m, state_off, S_M_STATE_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def write_grant(m, grant_off, req, token, term):
    """Publish a grant line (after the state line that names the same token).

    ``grant_seq`` is the word the waiter polls, so it is stored last: on coherent memory (and on
    CXL if the line is evicted early) each store is visible at once, and a waiter that saw the
    new ``grant_seq`` before the new token would hold the lock under its previous token.
    """
    K.store(m, grant_off + GRANT_TOKEN, token)
    K.store(m, grant_off + GRANT_TERM, term)
    K.store(m, grant_off + GRANT_NS, realtime_ns())
    K.store(m, grant_off + GRANT_CHECK, grant_check(req, token))
    K.store(m, grant_off + GRANT_SEQ, req)
    K.flush(m, grant_off, S_M_GRANT_FLUSH)
    K.full_fence(m)


@njit(cache=True, nogil=True)
def _still_manager(m, mgr_off, me, term, fence_deadline_ns):
    if realtime_ns() >= fence_deadline_ns:
        return SLICE_SELF_FENCED
    cur = K.load_fresh(m, mgr_off + MGR_TERM, S_M_TERM_READ)
    who = K.load(m, mgr_off + MGR_MANAGER)
    if cur != np.uint64(term) or who != np.uint64(me + 1):
        return SLICE_LOST_TERM
    return 0


@njit(cache=True, nogil=True)
def manager_step(m, locks_off, mgr_off, nlocks, max_nodes, live, st, granted, me, term,
                 fence_deadline_ns):
    """One scan of every lock: notice releases, grant the next waiter round-robin.

    ``st`` is int64[nlocks, M_COLS] (the manager's private copy of each state line), ``granted``
    int64[nlocks, max_nodes] the last req_seq granted to each node, ``live`` uint8[max_nodes].
    Returns the number of releases plus grants, or SLICE_LOST_TERM / SLICE_SELF_FENCED (then
    nothing was written). Before every grant the manager re-reads the manager line (another
    node may have been elected while this one stalled) and checks its own lease.
    """
    line = 64
    block = (1 + 2 * max_nodes) * line
    events = 0
    for lk in range(nlocks):
        state_off = locks_off + lk * block
        h = st[lk, M_HOLDER]
        if h >= 0:
            req_off = state_off + (1 + h) * line
            rel = K.load_fresh(m, req_off + REL_SEQ, S_M_REQ_READ)
            if np.int64(rel) < st[lk, M_HOLDER_REQ]:
                continue  # still held
            rc = _still_manager(m, mgr_off, me, term, fence_deadline_ns)
            if rc != 0:
                return rc
            st[lk, M_HOLDER] = -1
            write_state(m, state_off, st[lk], term)
            events += 1
        cursor = st[lk, M_RR]
        for k in range(1, max_nodes + 1):
            j = (cursor + k) % max_nodes
            if live[j] == 0:
                continue
            req_off = state_off + (1 + j) * line
            req = np.int64(K.load_fresh(m, req_off + REQ_SEQ, S_M_REQ_READ))
            rel = np.int64(K.load(m, req_off + REL_SEQ))
            if req > rel and req > granted[lk, j]:
                rc = _still_manager(m, mgr_off, me, term, fence_deadline_ns)
                if rc != 0:
                    return rc
                st[lk, M_SEQ] += 1
                token = (np.int64(term) << TOKEN_TERM_SHIFT) | st[lk, M_SEQ]
                st[lk, M_HOLDER] = j
                st[lk, M_HOLDER_REQ] = req
                st[lk, M_TOKEN] = token
                st[lk, M_GRANTS] += 1
                st[lk, M_RR] = j
                write_state(m, state_off, st[lk], term)           # 1. state names the token
                write_grant(m, state_off + (1 + max_nodes + j) * line, req, token, term)  # 2.
                granted[lk, j] = req
                events += 1
                break
    return events


@njit(cache=True, nogil=True)
def manager_slice(m, locks_off, mgr_off, nlocks, max_nodes, live, st, granted, me, term,
                  fence_deadline_ns, budget_ns, spin_ns, sleep_us_max, idle_ns, bell_fd,
                  bell_after_ns, bell_wait_ms, bell_buf, bell_stats, yield_state):
    """Run ``manager_step`` for up to ``budget_ns``, polling politely; nogil.

    ``idle_ns`` is how long the manager has already been idle when the slice starts: it spins
    with ``sched_yield`` while the lock was busy within the last ``spin_ns`` (``polite_yield``
    with ``yield_state``: sleeping instead while yields are slow) and backs off to
    ``usleep`` (doubling up to ``sleep_us_max``) after that; idle for ``bell_after_ns``, it
    waits up to ``bell_wait_ms`` (and not past the slice's budget) for the bell socket
    ``bell_fd`` (non-blocking) to be readable instead, then drains it (``sync/bell.py``: a
    ring ends the wait; -1: no bell).
    ``bell_stats`` counts the bell's sleeps [0] and the rings heard [1]; ``bell_buf`` is the
    address of 64 scratch bytes. Returns (events or error code, idle_ns at the end).
    """
    start = monotonic_ns()
    last_event = start - idle_ns
    total = 0
    sleep_us = 1
    while True:
        ev = manager_step(m, locks_off, mgr_off, nlocks, max_nodes, live, st, granted, me, term,
                          fence_deadline_ns)
        now = monotonic_ns()
        if ev < 0:
            return ev, now - last_event
        if ev > 0:
            total += ev
            last_event = now
            sleep_us = 1
        if now - start >= budget_ns:
            return total, now - last_event
        if now - last_event < spin_ns and polite_yield(yield_state, now):
            pass
        elif bell_fd >= 0 and now - last_event >= bell_after_ns:
            bell_stats[0] += 1
            left_ms = (budget_ns - (now - start)) // 1_000_000 + 1   # not past the slice's end
            if fd_wait_readable(bell_fd, min(bell_wait_ms, left_ms)) > 0:   # a ring (else timeout)
                bell_stats[1] += 1
                while fd_read(bell_fd, bell_buf, 64) >= 0:       # non-blocking: drain
                    pass
        else:
            usleep(sleep_us)
            sleep_us = min(sleep_us * 2, sleep_us_max)


@njit(cache=True, nogil=True)
def read_word_fresh(m, off, site):
    """load_fresh re-exported for the Python halves (one jitted call)."""
    return K.load_fresh(m, off, site)

