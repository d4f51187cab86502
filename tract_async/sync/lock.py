"""GlobalLock: the rack-wide lock without atomics, waiter side.

Two tiers (TraCT section "two-tier inter-node locking"). First the node-local tier
(``local.py``: an asyncio lock, then an OFD byte lock of the region file) lets at most one
contender per node reach the region. Then the global tier (``slots.py``): post W on this node's
request line, wait until the lock manager (``manager.py``) writes this request's number into this
node's grant line, hold, post I. The protocol, its lines and writers, and the fencing argument
are in ``slots.py``; this module is the asyncio shape around it.

Waiting: the grant is first polled in the event loop for ``PollPolicy.loop_spin_s``, in nogil
slices of ``loop_slice_s`` (the GIL free for a manager thread of this process; other tasks run
between slices: the cheap path when the manager is quick), then from one worker thread
in slices of ``slice_s`` (a nogil jitted poll: ``sched_yield`` for ``thread_spin_s`` while
yields are cheap -- beside a busy task it sleeps instead, ``tract_kernels.yielding`` -- then
``usleep`` doubling up to ``sleep_us_max``), which checks the deadline and a stop flag (set on
cancellation) between slices, so that both are honoured within one slice. The thread needs
nothing of the loop between slices (it used to return to the loop after every slice: a blocked
loop then left a grant unseen, and unreturned, for as long as it stayed blocked). A request
that times out or is cancelled is withdrawn (``rel_seq = req_seq``); if the grant raced the withdrawal, the manager
sees the withdrawal as a release, so the lock is never left held by nobody.

Handing a grant back. A grant seen by the polling thread is the waiter's only once its event
loop runs again. A loop blocked meanwhile (a model step, a long compile, a loop of transfers
that never suspends) would hold the rack's lock for as long as it stays blocked, although the
manager keeps granting (issue 13 point 6: one busy process must not freeze the rack). So the
thread that sees the grant asks the loop to confirm (``call_soon_threadsafe``) and waits
``PollPolicy.handback_s`` for it; a loop that does not answer in time gets the grant handed
back: the thread withdraws the request (``rel_seq = req_seq``, which the manager takes as a
release: the protocol's withdrawal racing a grant, nothing new on memory), and the coroutine
posts a fresh request when its loop runs again. A blocked loop holds the rack's lock for at most
``handback_s`` then, not for the whole block. The confirmation costs one more loop wake-up on a
grant that came through the thread (a wait longer than the in-loop spin); grants polled in the
loop need none.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass

from tract_kernels.yielding import STATE as YIELD_STATE

from ..host.timerslack import call_tight
from ..errors import LockBusy, LockNotHeld, LockRevoked, LockTimeout
from ..region import nodes as nodes_mod
from . import slots as S
from .bell import BellRinger
from .local import NodeLocalLock


@dataclass(frozen=True, kw_only=True)
class PollPolicy:
    """How a waiter polls for its grant (see the module docstring).

    Defaults follow the 2-core measurements: a short in-loop phase, then a thread that yields
    for a while and sleeps after that, so that idle waiters cost little CPU.
    """
    loop_spin_s: float = 50e-6
    loop_slice_s: float = 10e-6
    thread_spin_s: float = 500e-6
    sleep_us_max: int = 200
    slice_s: float = 0.005
    nowait_s: float = 0.002
    handback_s: float = 0.02
    """How long a grant seen by the polling thread waits for its event loop before it is handed
    back (module docstring); 0 keeps every grant however long the loop takes. Above the GIL's
    5 ms switch interval, so that a loop that only waits for the GIL keeps its grant."""


@dataclass(frozen=True, kw_only=True)
class LockStatistics:
    """A snapshot of one GlobalLock object's counters and the lock's state line."""
    acquisitions: int
    timeouts: int
    busy: int
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float
    holder: int | None          # node id named by the manager's state line, None when free
    token: int                  # current/last token in the state line
    grants: int                 # grants issued by all managers
    revocations: int            # holders revoked for a stale heartbeat
    held_by_me: bool
    handbacks: int = 0          # grants handed back because this process's loop was busy


async def run_slice(loop: asyncio.AbstractEventLoop, fn, *args,  # noqa: ANN001, ANN201
                    stop: list[bool] | None = None):
    """Run a bounded nogil poll in a worker thread; on cancellation set ``stop[0]`` (a poll
    that checks it between its slices) and wait for it to end (at most one slice) before
    re-raising, so that nobody touches its Mem concurrently."""
    fut = loop.run_in_executor(None, call_tight, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if stop is not None:
            stop[0] = True
        await asyncio.wait([fut])
        raise


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


class GlobalLock:
    """The rack-wide lock ``lock_index`` of ``region``, used by node ``node_handle``.

    ``node_handle`` is the NodeHandle of this node (from ``region.nodes.join``); a helper process
    of the same node may pass a copy of it (only ``node_id`` and ``epoch`` are used here).
    Use ``async with lock:`` or ``await acquire(timeout=...)`` / ``release()``. While held,
    ``token`` is the fencing token and ``check_token()`` re-validates it before a write batch.
    """

    def __init__(self, region, node_handle, *, lock_index: int = 0,  # noqa: ANN001
                 policy: PollPolicy = PollPolicy(),
                 liveness_timeout_s: float | None = None) -> None:
        self._region = region
        self._geo = S.geometry(region)
        if not 0 <= lock_index < self._geo.num_locks:
            raise ValueError(f"lock_index {lock_index} out of range: the region has "
                             f"{self._geo.num_locks} locks")
        region.nodes.line_offset(node_handle.node_id)  # raises NodeIdOutOfRange
        self.node_id = int(node_handle.node_id)
        self._epoch = int(node_handle.epoch)
        self.lock_index = lock_index
        self.policy = policy
        self._req_off = self._geo.req_off(lock_index, self.node_id)
        self._grant_off = self._geo.grant_off(lock_index, self.node_id)
        self._state_off = self._geo.state_off(lock_index)
        self._local = NodeLocalLock(region.path, lock_index, self.node_id)
        self._mem = S.private_view(region, 1000 + 64 * lock_index + self.node_id)
        # the holder lease (check_token): half the liveness timeout that defines dead; None
        # (tools, tests without a beating node): no lease
        self._beat_off = region.nodes.heartbeat_offset(self.node_id)
        self._lease_ns = (int(liveness_timeout_s / 2 * 1e9)
                          if liveness_timeout_s is not None else 0)
        self.lease_lapses = 0
        self._req = 0
        self._token = 0
        self._held = False
        self._acquired_at = 0.0
        self._waits: collections.deque[float] = collections.deque(maxlen=4096)
        self._acquisitions = 0
        self._timeouts = 0
        self._busy = 0
        self._handbacks = 0
        self._bell = BellRinger(region)
        """Rings the manager after a request or a release (``sync/bell.py``)."""

    # -- properties ---------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._held

    @property
    def token(self) -> int:
        """The fencing token of the current hold. Raises LockNotHeld when not held."""
        if not self._held:
            raise LockNotHeld(f"lock {self.lock_index} is not held by node {self.node_id}")
        return self._token

    @property
    def wanted(self) -> bool:
        """True while a task of this process waits for this lock or holds it (the node-local
        tier is taken). Callers that may run many transfers without suspending yield a loop
        turn while it is (``stores/region.py``, "Yielding to this node's lock")."""
        return self._local.locked

    def locked(self) -> bool:
        """True while some node holds the lock (reads the manager's state line)."""
        return self._read_state()["holder"] is not None

    # -- acquire / release --------------------------------------------------------------------
    async def acquire(self, timeout: float | None = None) -> int:
        """Wait for the lock; returns the fencing token.

        Raises LockTimeout (``timeout`` seconds passed; nothing is held afterwards),
        asyncio.CancelledError (the request is withdrawn first).
        """
        t0 = time.monotonic()
        deadline = t0 + (timeout if timeout is not None else 1e9)
        await self._local.acquire(deadline)
        try:
            m = self._mem
            req, token = await self._wait_grant(m, deadline)
        except BaseException:
            self._local.release()
            raise
        if token == 0:
            try:
                self._withdraw(req)
            finally:   # nothing is held after a timeout: the node-local tier neither
                self._local.release()
            self._timeouts += 1
            raise LockTimeout(f"global lock {self.lock_index} not granted to node {self.node_id} "
                              f"within {timeout} s (is a LockManager running on a live node?) "
                              f"[{self.diagnosis()}]")
        self._granted(req, token, time.monotonic() - t0)
        return token

    async def _wait_grant(self, m, deadline: float) -> tuple[int, int]:  # noqa: ANN001
        """Post a request and wait for its grant: (request, token), token 0 at the deadline
        (the request is still posted then). A grant handed back by the polling thread (module
        docstring) is followed by a fresh request."""
        while True:
            req = int(S.post_request(m, self._req_off, self._epoch))
            self._bell.ring()
            tok = await self._wait_one(m, req, deadline)
            if tok >= 0:
                return req, tok

    async def _wait_one(self, m, req: int, deadline: float) -> int:  # noqa: ANN001
        """The grant of ``req``: its token, 0 at the deadline, -1 when the polling thread handed
        it back (withdrawn already)."""
        pol = self.policy
        try:
            spin_end = time.monotonic() + pol.loop_spin_s
            slice_ns = int(pol.loop_slice_s * 1e9)
            tok = int(S.poll_grant(m, self._grant_off, req))
            while not tok:
                now = time.monotonic()
                if now >= spin_end or now >= deadline:
                    break
                await asyncio.sleep(0)
                # a slice of the nogil poll on the loop's thread: the GIL is free meanwhile, so
                # a lock manager thread of this process can grant (a Python-level poll between
                # sleep(0)s held the GIL and kept it waiting)
                tok = int(S.wait_grant(m, self._grant_off, req, slice_ns, slice_ns,
                                       pol.sleep_us_max, YIELD_STATE))
            if tok:
                return tok
            if time.monotonic() >= deadline:
                return 0
            loop = asyncio.get_running_loop()
            stop = [False]
            return int(await run_slice(loop, self._poll_in_thread, loop, m, req, deadline, stop,
                                       stop=stop))
        except BaseException:
            self._withdraw(req)
            raise

    def _poll_in_thread(self, loop: asyncio.AbstractEventLoop, m, req: int,  # noqa: ANN001
                        deadline: float, stop: list[bool]) -> int:
        """The thread's poll (a worker thread, one per wait: it needs nothing of the loop, so
        a grant that comes while the loop is blocked is still seen): the token; 0 at the
        deadline or once ``stop[0]`` is set (checked every ``slice_s``); -1 when a grant came
        but the loop did not confirm it within ``handback_s`` and it was handed back."""
        pol = self.policy
        spin_ns = int(pol.thread_spin_s * 1e9)
        while True:
            now = time.monotonic()
            if now >= deadline or stop[0]:
                return 0
            budget = int(min(pol.slice_s, deadline - now) * 1e9)
            tok = int(S.wait_grant(m, self._grant_off, req, budget, spin_ns, pol.sleep_us_max,
                                   YIELD_STATE))
            if tok:
                break
            spin_ns = 0  # later slices go straight to the sleeping phase
        if pol.handback_s <= 0:
            return tok
        picked = threading.Event()
        try:
            loop.call_soon_threadsafe(picked.set)
        except RuntimeError:        # the loop is closed: nobody will take the grant
            picked.clear()
        if picked.wait(pol.handback_s):
            return tok
        S.release(m, self._req_off, req)      # the manager takes it as a release
        self._handbacks += 1
        return -1

    def acquire_nowait(self) -> int:
        """Take the lock only if the manager grants it almost at once; returns the token.

        "At once" is up to ``policy.nowait_s`` of polling (the manager must see the request: a
        lock without atomics cannot be taken with a single instruction). Raises LockBusy.
        The poll is synchronous and blocks this event loop: a LockManager running on the same
        loop can grant only from a scan slice already in flight, so LockBusy is more likely there.
        """
        t0 = time.monotonic()
        if not self._local.acquire_nowait():
            self._busy += 1
            raise LockBusy(f"lock {self.lock_index} is in use on node {self.node_id}")
        m = self._mem
        req = int(S.post_request(m, self._req_off, self._epoch))
        self._bell.ring()
        budget = int(self.policy.nowait_s * 1e9)
        token = int(S.wait_grant(m, self._grant_off, req, budget, budget, 1, YIELD_STATE))
        if token == 0:
            self._withdraw(req)
            self._local.release()
            self._busy += 1
            raise LockBusy(f"global lock {self.lock_index} was not granted within "
                           f"{self.policy.nowait_s} s")
        self._granted(req, token, time.monotonic() - t0)
        return token

    def _granted(self, req: int, token: int, waited_s: float) -> None:
        self._req, self._token, self._held = req, token, True
        self._acquired_at = time.monotonic()
        self._acquisitions += 1
        self._waits.append(waited_s)

    def _withdraw(self, req: int) -> None:
        S.release(self._mem, self._req_off, req)

    def release(self) -> None:
        """Release the lock. The critical section's writes must already be flushed by their
        writer (the kernels' publish rule). Raises LockNotHeld."""
        if not self._held:
            raise LockNotHeld(f"release() of lock {self.lock_index} on node {self.node_id}, "
                              f"which does not hold it")
        self._held = False
        self._token = 0
        try:
            S.release(self._mem, self._req_off, self._req)
            self._bell.ring()        # another node's request may be waiting for this release
        finally:
            self._local.release()

    def check_token(self) -> None:
        """Re-validate the fencing token against the manager's state line.

        Call it before every batch of metadata writes. Raises LockRevoked (this holder was
        revoked, or, with a ``liveness_timeout_s``, its lease lapsed: its own heartbeat is half
        that timeout old, so a revocation may be in flight; stop writing and release),
        LockNotHeld.
        """
        if not self._held:
            raise LockNotHeld(f"check_token() without holding lock {self.lock_index}")
        got = S.check_token_leased(self._mem, self._state_off, self.node_id, self._token,
                                   self._beat_off, self._lease_ns)
        if got == S.LEASE_LAPSED:
            self.lease_lapses += 1
            age = self._region.nodes.info(self.node_id).heartbeat_age_s
            raise LockRevoked(f"node {self.node_id}'s hold of lock {self.lock_index} lapsed: "
                              f"its own heartbeat is {age:.3f} s old, at least half the "
                              f"liveness timeout ({2 * self._lease_ns / 1e9:.3f} s), so a "
                              f"revocation may be in flight: its writes are refused (a "
                              f"paused or starved process; model finding A2)")
        if got != S.TOKEN_OK:
            st = self._read_state()
            raise LockRevoked(f"node {self.node_id}'s token {self._token:#x} for lock "
                              f"{self.lock_index} was revoked (heartbeat stale?): its writes "
                              f"are refused (lock state now: holder {st['holder']}, token "
                              f"{st['token']:#x}, revocations {st['revocations']})")

    def token_valid(self) -> bool:
        """check_token() as a boolean (False when not held)."""
        return self._held and bool(S.check_token(self._mem, self._state_off,
                                                 self.node_id, self._token))

    async def __aenter__(self) -> int:
        return await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        if self._held:
            self.release()

    # -- introspection ------------------------------------------------------------------------
    def _read_state(self) -> dict:
        import numpy as np

        import tract_kernels as K
        raw = np.zeros(64, dtype=np.uint8)
        # the calling thread's view, not this lock's: stats() may run on the loop while a
        # waiter's slice uses ``self._mem`` in a worker thread (the sim's caches are per thread)
        K.read_bytes(self._region.mem, self._state_off, raw.ctypes.data, 64, S.S_STATE_READ)
        rec = raw.view(S.L.LOCK_STATE.dtype)[0]
        holder = int(rec["holder"])
        return {"holder": holder - 1 if holder else None, "token": int(rec["token"]),
                "grants": int(rec["grants"]), "revocations": int(rec["revocations"])}

    def diagnosis(self) -> str:
        """One line on why a grant may not come: the manager line (node, term, whether it is
        valid, how old its scan stamp is), the lock's holder, this node's request and grant
        sequences, and each node's liveness. Fresh reads through the calling thread's view;
        for error messages, not for decisions."""
        import numpy as np

        import tract_kernels as K
        from .manager_line import manager_valid, read_manager, read_scan_ns
        try:
            m, geo = self._region.mem, self._geo
            nodes = self._region.nodes.all(confirm=False)
            info = read_manager(self._region, geo, m)
            parts = []
            if info.node_id is None:
                parts.append(f"no manager (term {info.term})")
            else:
                scan = read_scan_ns(self._region, info.node_id, geo, m)
                age = (time.time_ns() - scan) / 1e9 if scan else float("inf")
                ok = manager_valid(info, nodes)
                parts.append(f"manager node {info.node_id} term {info.term} "
                             f"{'valid' if ok else 'invalid'}, scan stamp {age:.3f} s old")
            st = self._read_state()
            raw = np.zeros(64, dtype=np.uint8)
            K.read_bytes(m, self._req_off, raw.ctypes.data, 64, S.S_REQ_RELOAD)
            req = raw.view(S.L.LOCK_REQ.dtype)[0].copy()
            K.read_bytes(m, self._grant_off, raw.ctypes.data, 64, S.S_GRANT_READ)
            grant = raw.view(S.L.LOCK_GRANT.dtype)[0].copy()
            now = time.time_ns()
            parts.append(f"holder {st['holder']} token {st['token']:#x} grants {st['grants']}")
            parts.append(
                f"node {self.node_id} req_seq {int(req['req_seq'])} (requested "
                f"{(now - int(req['requested_ns'])) / 1e9:.3f} s ago) rel_seq "
                f"{int(req['rel_seq'])} grant_seq {int(grant['grant_seq'])} (granted "
                f"{(now - int(grant['granted_ns'])) / 1e9:.3f} s ago, token "
                f"{int(grant['token']):#x})")
            parts.append("nodes " + ", ".join(
                f"{n.node_id}:{n.state_name}{'' if n.live else ' stale'}"
                f"({n.heartbeat_age_s:.2f} s)" for n in nodes if n.state_name != "free"))
            return "; ".join(parts)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the error it explains
            return f"no diagnosis: {exc!r}"

    def statistics(self) -> LockStatistics:
        """Counters of this object plus the lock's current holder and revocation count."""
        st = self._read_state()
        waits = list(self._waits)
        return LockStatistics(
            acquisitions=self._acquisitions, timeouts=self._timeouts, busy=self._busy,
            wait_p50_s=_pct(waits, 50), wait_p99_s=_pct(waits, 99),
            wait_max_s=max(waits) if waits else float("nan"), holder=st["holder"],
            token=st["token"], grants=st["grants"], revocations=st["revocations"],
            held_by_me=self._held, handbacks=self._handbacks)

    def close(self) -> None:
        """Release if held and drop the node-local lock's file description. Idempotent."""
        if self._held:
            self.release()
        self._local.close()
        self._bell.close()


DEFAULT_LIVENESS_TIMEOUT_S = nodes_mod.DEFAULT_LIVENESS_TIMEOUT_S
