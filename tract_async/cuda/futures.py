"""StreamFuture: an awaitable tied to a CUDA event, and the one poller thread that resolves them.

A transfer is enqueued on the engine's copy streams and ends with an event. Its StreamFuture

* is awaitable without blocking the event loop: one poller thread per process watches every
  outstanding event (``event.query()``, a few hundred nanoseconds, no device sync) and hands the
  completion to the future's loop with ``call_soon_threadsafe``. There is no thread, task or
  spinning core per future;
* runs its *completion* exactly once, on the loop, as soon as the event has completed and
  whether or not anybody awaits: that is where a put publishes its layer bits (docs/design.md
  invariant 5: after the bytes) and a get re-validates its block versions (invariant 6: after
  the DMA). Awaiting returns the completion's result or raises its error;
* may carry an *early* step that the poller runs on its own thread as soon as it sees the event
  complete, before it hands the completion to the loop: a put's layer bits and doorbells
  (``BlockLifecycle.publish_early``), so that publication follows the stream, not the
  producer's event loop (which may be blocked in a CUDA synchronize for the whole prefill);
* can order a consumer stream after the transfer with ``wait_stream(stream)`` (``cudaStreamWait
  Event``: no host synchronization). For a get, the data is *trusted* only once the completion
  has validated it: work ordered with ``wait_stream`` is speculative until ``await fut``
  returns (a failed validation raises BlockEvicted: discard what was computed).

Polling policy (why not a blocking wait per event: that is a thread per future or a spinning
``cudaEventSynchronize``): the poller sleeps on a condition variable while nothing is
outstanding; otherwise it queries every outstanding event, resolves the completed ones, and
sleeps with exponential backoff from ``min_sleep_s`` to ``max_sleep_s`` (20 -> 200 µs) while
nothing completes. A future may carry ``not_before``: the earliest time it can complete (its
bytes over the link's bandwidth); the poller does not query it earlier, so a 1 GiB transfer costs
a handful of wake-ups instead of ~100. From ``not_before`` on, the transfer is about to land: for
a while after it (``due_until``: half the time to ``not_before`` again, plus 200 µs) the poller
looks every ``min_sleep_s`` instead of backing off. Backing off there cost a 64 MiB layer up to
200 µs of lateness on top of the loop's wake-up: its await came 365-459 µs after its DMA had
landed on the H100 host (``bench/gpu_layers.py``, ``future_added_us`` at 1024 blocks,
``bench/results/gpu-20261207-s48``). Cost per future: one list append, some queries, one
``call_soon_threadsafe``.

Cancellation (trio's abort protocol): ``cancel()`` before the completion ran means the completion
will not run (the put does not publish); the bytes may still be moving, so whoever owns the
destination waits with ``await fut.wait_landed()`` before reusing or freeing it.
"""
from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from typing import Any, Callable, Protocol

from ..host.timerslack import tighten
from .events import DONE


DUE_SLACK_S = 200e-6
"""Part of a future's due window (``StreamFuture.due_until``) beyond its relative half."""

SPIN_ADMIT = 0.75
"""An awaiter spins (``StreamFuture._spin``) when its transfer's ``not_before`` is at most this
part of the spin budget away. ``not_before`` assumes 60 GB/s; the H100 host's DMAs run at 45-54
(a 64 MiB layer: not_before 1.12 ms, landed 1.42 ms after its start), so the spin, which lasts
the budget, still sees a transfer land that it admitted at 3/4 of the budget. Half the budget
(until session 51) left every 64 MiB layer (1024 blocks) to the poller and the loop's wake-up:
its await came 240-300 µs after the event had completed (``bench/gpu_layers.py``: e2e 1.66 /
1.76 ms against event-synced 1.42 / 1.46, put / get, ``bench/results/gpu-20261207-s51``), where
the spin ends at the landing."""

LAND_SLACK = 1.2
"""When a transfer is expected to land: ``t_submit + (not_before - t_submit) * LAND_SLACK`` (the
H100 host's large DMAs run at ~50 GB/s against the 60 that ``not_before`` assumes)."""

NAP_MAX_S = 0.012
"""An awaiter of a transfer due later than the spin admits, but within this (a whole 426 MiB
prompt: ``not_before`` 7.45 ms), lets its loop run until half its spin budget before the
expected landing, then spins (``StreamFuture._nap_s``). Through the poller the await came
0.15-0.31 ms after the landing for whole prompts on the H100 host (``bench/gpu_layers.py``:
put 10.34 ms awaited against 10.02 event-synced, get 9.49 against 9.33,
``bench/results/gpu-20261207-s51``). Longer transfers: the estimate's error outgrows the
budget, so the poller resolves them."""

DUE_ENV = "TRACT_CUDA_POLL_DUE"
"""``0``: no due windows (the poller backs off as soon as it looks), for A/B runs."""

_DUE_ON = os.environ.get(DUE_ENV, "1") != "0"


class EventLike(Protocol):
    """What the future needs of an event: ``torch.cuda.Event`` has both."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Poller:
    """The process-wide poller thread: started on the first future, exits after ``idle_exit_s``
    with nothing outstanding (a later future starts it again)."""

    def __init__(self, *, min_sleep_s: float = 20e-6, max_sleep_s: float = 200e-6,
                 idle_exit_s: float = 5.0) -> None:
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self.idle_exit_s = idle_exit_s
        self._life = threading.Lock()
        """Held to start the thread (``add``) and to decide to end it (the poller): so an add
        racing the poller's exit either is seen by it or starts the next thread."""
        self._wake = threading.Lock()
        """A binary semaphore: released (unlocked) by ``add`` to wake an idle poller, which
        waits by acquiring it. Unlike a condition's notify, the waker takes no lock the woken
        thread holds: with one, an add waited out the woken poller's round for the GIL (35 µs
        of an add on the VM, ``bench/results/vm-20261207-s51``)."""
        self._wake.acquire()
        self._inbox: collections.deque[StreamFuture] = collections.deque()
        """New futures: appended by any thread without a lock (``add``), taken by the poller."""
        self._pending: list[StreamFuture] = []
        """The futures the poller watches: its thread's alone."""
        self._idle = True
        """The poller is about to wait for ``_wake``, waits there, or has no thread: ``add``
        must wake or start it. Set before the poller's last look at the inbox; cleared by a
        started or woken poller before it looks at the inbox again: so an ``add`` that reads it
        clear appended before the poller's next look, and the poller finds its future."""
        self._thread: threading.Thread | None = None
        # counters (read without the lock: approximate is fine)
        self.wakeups = 0
        self.queries = 0
        self.resolved = 0
        self.skipped = 0
        """Futures dropped because their loop had seen them land first (no call into it)."""
        self.threads_started = 0
        self.due_looks = 0
        """Looks taken while a future was due and within its ``due_until``."""
        self.max_due_wait_s = 0.0
        """The longest sleep after such a look."""

    def add(self, fut: "StreamFuture") -> None:
        """Watch ``fut``. One deque append while the poller is polling (a condition's lock and
        notify on every add were ~3 µs of a one-block layer operation's own time in the H100
        host's profile); a wake (``_wake``) for an idle poller, which a layer stream in
        transfer mode finds at most operations (``gpu-20261207-s51`` call 5); the start of a
        thread when none runs."""
        self._inbox.append(fut)
        if self._idle:
            with self._life:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tract-cuda-poller",
                                                    daemon=True)
                    self.threads_started += 1
                    self._thread.start()
                    return
            try:
                self._wake.release()
            except RuntimeError:
                pass                    # a wake is pending already

    @property
    def outstanding(self) -> int:
        return len(self._pending) + len(self._inbox)

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def _run(self) -> None:
        tighten()           # a 20 µs sleep should take 20 µs, not 70 (timerslack.py)
        sleep = self.min_sleep_s
        inbox, wake = self._inbox, self._wake
        self._idle = False  # (the inbox is looked at next)
        while True:
            while inbox:                # only this thread takes from the inbox
                self._pending.append(inbox.popleft())
            if not self._pending:
                self._idle = True
                if not inbox and not wake.acquire(timeout=self.idle_exit_s):
                    with self._life:
                        if not inbox:
                            # an add from now on sees _idle, takes _life after this block and
                            # starts a new thread
                            self._thread = None
                            return
                self._idle = False
                continue
            batch = self._pending
            self.wakeups += 1
            now = time.perf_counter()
            done: list[StreamFuture] = []
            earliest = float("inf")
            due = False         # a future past its not_before, still within its due window
            for f in batch:
                if f._is_landed:
                    # seen landed on its loop already (an awaiter's spin, ``synchronize``):
                    # dropped without a call into the loop, whose self-pipe write and wake-up
                    # were the largest single item of a one-block layer operation's host time
                    # on the H100 host (``bench/results/gpu-20261207-s48``, call 7)
                    done.append(f)
                    self.skipped += 1
                    continue
                if f.not_before > now:
                    earliest = min(earliest, f.not_before)
                    continue
                self.queries += 1
                try:
                    landed = f.event.query()
                except Exception as e:  # a CUDA error: report it through the future
                    f._poll_error = e
                    landed = True
                if landed:
                    done.append(f)
                elif now < f.due_until:
                    due = True
            if done:
                gone = set(map(id, done))
                self._pending = [f for f in batch if id(f) not in gone]
                for f in done:
                    if f._is_landed:
                        continue
                    if f._early is not None and f._poll_error is None:
                        f._run_early()
                    f._landed_from_poller()
                    self.resolved += 1
                sleep = self.min_sleep_s
                continue
            if due:             # about to land: look again soon, no backoff
                self.due_looks += 1
                wait = self.min_sleep_s
                if wait > self.max_due_wait_s:
                    self.max_due_wait_s = wait
            elif (earliest != float("inf") and len(batch)
                  and all(f.not_before > now for f in batch)):
                wait = max(sleep, earliest - now)
            else:
                wait = sleep
            time.sleep(min(wait, 0.05))
            sleep = self.min_sleep_s if due else min(self.max_sleep_s, sleep * 2)


_POLLER: Poller | None = None
_POLLER_LOCK = threading.Lock()


def poller() -> Poller:
    """The process-wide poller (created on first use; no lock once it exists)."""
    global _POLLER
    p = _POLLER
    if p is not None:
        return p
    with _POLLER_LOCK:
        if _POLLER is None:
            _POLLER = Poller()
        return _POLLER


_PENDING, _OK, _ERR, _CANCELLED = range(4)


class StreamFuture:
    """The outcome of a transfer enqueued on a CUDA stream; see the module docstring.

    ``completion()`` runs once on the loop after the event completed (publish / validate) and
    gives the result; ``keep`` holds tensors the transfer reads or writes (staging, sources)
    until the event has completed, so the caching allocator cannot hand them out under the DMA.
    Create it inside the loop that will await it.

    Its asyncio futures are made only when somebody must wait through the loop (``await``
    before the transfer landed and without a spin that saw it land, ``wait_landed``): a layer
    transfer awaited by a spinner that sees it land (the common case of a layer-streamed
    request) makes none. Two ``create_future`` calls and their bookkeeping were a measurable
    part of a one-block layer operation's host cost (~3.5 µs of a construction on the 2-core
    VM).
    """

    __slots__ = ("event", "_spin_ns", "nbytes", "label", "_completion", "_early", "_early_lock",
                 "_landed_flag", "_is_landed", "_landed_hooks", "_tracker", "early_done",
                 "early_error", "t_early", "_keep", "_loop", "_landed_fut", "_result_fut",
                 "_state", "_value", "_cancel_requested", "_poll_error", "t_submit",
                 "not_before", "due_until", "t_landed_seen", "t_completed",
                 "transfer_mode_info")

    def __init__(self, event: EventLike, *, completion: Callable[[], Any] | None = None,
                 keep: tuple[Any, ...] = (), nbytes: int = 0, not_before_s: float = 0.0,
                 poller_: Poller | None = None, label: str = "",
                 early: Callable[[], bool] | None = None, spin_ns: int = 0,
                 t_submit: float | None = None) -> None:
        self.event = event
        self._spin_ns = spin_ns
        self.nbytes = nbytes
        self.label = label
        self._completion = completion
        self._early = early
        self._early_lock = threading.Lock() if early is not None else None
        self._landed_flag = False       # (under _early_lock) the loop saw it land first
        self._is_landed = False
        self._landed_hooks: list[Callable[[], Any]] | None = None
        self._tracker: set[StreamFuture] | None = None     # (``track_in``)
        self.transfer_mode_info: Any = None
        """What the starter attaches for its finisher (a get's ``ReadTxn``)."""
        self.early_done = False
        """``early`` ran on the poller's thread and did its part (a put's layer bits)."""
        self.early_error: BaseException | None = None
        self.t_early: float | None = None       # when ``early`` finished (perf_counter)
        self._keep = keep
        self._loop = asyncio.get_running_loop()
        self._landed_fut: asyncio.Future[None] | None = None
        self._result_fut: asyncio.Future[Any] | None = None
        self._state = _PENDING
        self._value: Any = None
        self._cancel_requested = False
        self._poll_error: BaseException | None = None
        # ``t_submit``: when the transfer's first copy was enqueued, where a caller that enqueues
        # in parts made this future well after it: its nap and its ``not_before`` run from
        # there, not from the last part's enqueue
        self.t_submit = time.perf_counter() if t_submit is None else t_submit
        self.not_before = self.t_submit + not_before_s
        self.due_until = (self.not_before + 0.5 * not_before_s + DUE_SLACK_S
                          if not_before_s > 0 and _DUE_ON else 0.0)
        """Until when the poller looks every ``min_sleep_s`` once ``not_before`` has passed
        (module docstring)."""
        self.t_landed_seen: float | None = None     # when the poller saw the event complete
        self.t_completed: float | None = None       # when the completion ran on the loop
        (poller_ or poller()).add(self)

    # -- state --------------------------------------------------------------------------------
    def landed(self) -> bool:
        """The event has completed (the bytes are in place); the completion may not have run."""
        return self._is_landed or bool(self.event.query())

    @property
    def seen_landed(self) -> bool:
        """This side has seen the transfer land (and any early step has finished): nothing of
        it touches the region or its tensors any more."""
        return self._is_landed

    def done(self) -> bool:
        """The completion ran (or was cancelled): ``result()`` answers without waiting."""
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> Any:
        """The completion's result; raises its error, CancelledError, or InvalidStateError if not
        done yet."""
        st = self._state
        if st == _OK:
            return self._value
        if st == _ERR:
            raise self._value
        if st == _CANCELLED:
            raise asyncio.CancelledError()
        raise asyncio.InvalidStateError("the transfer's completion has not run yet")

    def landed_future(self) -> "asyncio.Future[None]":
        """An asyncio future of the landing (made on first use; done once landed)."""
        f = self._landed_fut
        if f is None:
            f = self._landed_fut = self._loop.create_future()
            if self._is_landed:
                f.set_result(None)
        return f

    def _result_future(self) -> "asyncio.Future[Any]":
        f = self._result_fut
        if f is None:
            f = self._result_fut = self._loop.create_future()
            st = self._state
            if st == _OK:
                f.set_result(self._value)
            elif st == _ERR:
                f.set_exception(self._value)
            elif st == _CANCELLED:
                f.cancel()
        return f

    # -- waiting ------------------------------------------------------------------------------
    def __await__(self):  # noqa: ANN204
        if self._state == _PENDING and self._spin_ns:
            nap = self._nap_s()
            if nap > 0:
                # the loop runs meanwhile; the poller's resolution (if first) ends the nap
                yield from asyncio.wait([self._result_future()], timeout=nap).__await__()
            if self._state == _PENDING:
                self._spin()
        if self._state != _PENDING:
            return self.result()        # (landed and completed here: no asyncio future made)
        # shielded: a cancelled awaiter does not cancel the transfer (see cancel())
        return (yield from asyncio.shield(self._result_future()).__await__())

    def _nap_s(self) -> float:
        """How long an awaiter with a spin budget lets its loop run before it spins: 0 for a
        transfer the spin admits now (``SPIN_ADMIT``) or one due later than ``NAP_MAX_S``
        (the poller's), else until half the budget before the expected landing
        (``LAND_SLACK``; the loop's timers wake up to a millisecond late, which that half
        covers on the GPU hosts' 2 ms budget)."""
        now = time.perf_counter()
        budget = self._spin_ns * 1e-9
        ahead = self.not_before - now
        if ahead <= budget * SPIN_ADMIT or ahead > NAP_MAX_S:
            return 0.0
        land = self.t_submit + (self.not_before - self.t_submit) * LAND_SLACK
        return max(0.0, land - budget / 2 - now)

    def _spin(self) -> None:
        """On the awaiting (loop) thread, when the transfer should land within ``SPIN_ADMIT`` of
        the spin budget (``not_before``): query the event in a tight loop for up to the budget
        and, once it completed, run the completion here.

        Why. Through the poller a completion costs its sleep granularity (20-200 µs) plus a
        wake-up of the loop (``call_soon_threadsafe``: a write to the loop's self-pipe, tens of
        µs on the GPU hosts, where a woken thread also runs slower): more than the DMA itself for
        a layer of a few blocks (2 MiB moves in ~48 µs). The budget is the engine's wait spin
        (``EngineConfig.wait_spin_us``: 2 ms on hosts of 8+ cores, 300 µs below), the same trade
        as a same-host wait: the loop is held at most that long per await, and only for a
        transfer that is about to land."""
        now = time.perf_counter()
        budget = self._spin_ns * 1e-9
        if self.not_before - now > budget * SPIN_ADMIT:
            return                      # lands later: the poller resolves it without a spinner
        end = now + budget
        ev = self.event
        try:
            while not ev.query():
                if time.perf_counter() > end:
                    return
        except Exception:               # a CUDA error: the poller reports it through the future
            return
        self.t_landed_seen = time.perf_counter()
        self._on_landed()

    async def wait_landed(self) -> None:
        """Wait until no more bytes can move (also after cancel()). Never raises the
        completion's error; a cancelled caller still gets CancelledError."""
        if self._is_landed:
            return
        await asyncio.wait([self.landed_future()])

    def on_landed(self, hook: Callable[[], Any]) -> None:
        """Run ``hook()`` on the loop's thread the moment the transfer is seen landed (at once
        if it already is): unlike a callback on an asyncio future, in the same step."""
        if self._is_landed:
            hook()
        elif self._landed_hooks is None:
            self._landed_hooks = [hook]
        else:
            self._landed_hooks.append(hook)

    def track_in(self, outstanding: "set[StreamFuture]") -> None:
        """Be in ``outstanding`` until seen landed (a ``CudaPath``'s transfers, which its
        ``drain`` waits for): what an ``on_landed`` hook would do, without a closure and a hook
        call per transfer."""
        if not self._is_landed:
            outstanding.add(self)
            self._tracker = outstanding

    def wait_stream(self, stream: Any) -> None:
        """Make ``stream`` wait for this transfer on the device (no host synchronization)."""
        ev = self.event
        w = getattr(ev, "wait_on", None)
        if w is not None:               # a raw event (cuda/events.py), or DONE
            w(int(stream.cuda_stream))
        else:
            stream.wait_event(ev)

    def synchronize(self) -> Any:
        """Block this thread until the event completed, run the completion now if it has not
        run, and return the result. Call it on the future's loop thread (or the loop is idle)."""
        self.event.synchronize()
        self._on_landed()
        return self.result()

    def cancel(self) -> bool:
        """Stop the completion from running (a put will not publish). True if it had not run.
        False also when the early step already did its part (a put's layer bits are out:
        the completion's bookkeeping then still runs). The DMA itself cannot be stopped:
        ``await wait_landed()`` before reusing its memory."""
        if self._state != _PENDING:
            return False
        lock = self._early_lock
        if lock is not None:
            with lock:
                if self.early_done:
                    return False
                self._cancel_requested = True
        else:
            self._cancel_requested = True
        self._state = _CANCELLED
        f = self._result_fut
        if f is not None:
            f.cancel()
        return True

    def _run_early(self) -> None:
        """On the poller's thread, once the event completed: the early step, unless cancelled
        first (``cancel`` and this exclude each other). An error leaves the whole job to the
        completion, on the loop, which reports it."""
        lock = self._early_lock
        if lock is None:
            return
        with lock:
            if self._cancel_requested or self._landed_flag:
                return  # cancelled, or the loop saw it land first and ran the whole completion
            try:
                self.early_done = bool(self._early())  # type: ignore[misc]
            except BaseException as e:  # noqa: BLE001 - the completion redoes it and reports
                self.early_error = e
        self.t_early = time.perf_counter()

    # -- completion ---------------------------------------------------------------------------
    def _landed_from_poller(self) -> None:
        self.t_landed_seen = time.perf_counter()
        try:
            self._loop.call_soon_threadsafe(self._on_landed)
        except RuntimeError:  # the loop is closed: nobody can observe the result any more
            self._keep = ()

    def _on_landed(self) -> None:
        if self._is_landed:
            return
        lock = self._early_lock
        if lock is not None:
            # an early step still running finishes first, and none starts after this: once
            # landed nothing of this transfer touches the region (drain() relies on it before
            # the region is unmapped)
            with lock:
                self._landed_flag = True
        self._is_landed = True
        ev = self.event
        rel = getattr(ev, "release", None)
        if rel is not None:             # a pooled raw event: reusable from now on
            self.event = DONE
            rel()
        f = self._landed_fut
        if f is not None and not f.done():
            f.set_result(None)
        tr = self._tracker
        if tr is not None:
            self._tracker = None
            tr.discard(self)
        hooks = self._landed_hooks
        if hooks is not None:            # at once, not a loop round later (bookkeeping)
            self._landed_hooks = None
            for hook in hooks:
                hook()
        self._keep = ()
        if self._state != _PENDING:
            return  # cancelled before landing: the completion does not run
        self.t_completed = time.perf_counter()
        if self._poll_error is not None:
            self._finish(_ERR, self._poll_error)
            return
        try:
            value = self._completion() if self._completion is not None else None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiter
            self._finish(_ERR, e)
        else:
            self._finish(_OK, value)

    def _finish(self, state: int, value: Any) -> None:
        self._state = state
        self._value = value
        f = self._result_fut
        if f is None or f.done():
            return
        if state == _OK:
            f.set_result(value)
        else:
            f.set_exception(value)
            # nobody may await a detached transfer: do not warn "exception never retrieved"
            # for errors the owner chose not to look at; stats count them
            f.exception()

    def __repr__(self) -> str:
        state = "done" if self.done() else ("landed" if self._is_landed else "pending")
        return f"<StreamFuture {self.label or ''} {self.nbytes} B {state}>"
