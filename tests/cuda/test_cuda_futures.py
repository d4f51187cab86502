"""StreamFuture and the poller, with fake events (no CUDA needed): completion order, exactly-once
completion, cancellation that stops publication but still waits for the bytes, no busy polling,
no event-loop blocking. Written as sync tests around asyncio.run so they need no plugin."""
from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from tract_async.cuda.futures import NAP_MAX_S, Poller, StreamFuture


class FakeEvent:
    """An event that completes when ``fire()`` is called (from any thread)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.queries = 0

    def fire(self) -> None:
        self._done.set()

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


def fire_later(ev: FakeEvent, delay_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), ev.fire()))
    t.start()
    return t


def test_await_resolves_after_the_event_and_runs_completion_once():
    calls = []

    async def main():
        p = Poller()
        ev = FakeEvent()
        fut = StreamFuture(ev, completion=lambda: calls.append(1) or 42, poller_=p)
        assert not fut.done() and not fut.landed()
        th = fire_later(ev, 0.02)
        assert await fut == 42
        assert await fut == 42            # awaiting again gives the same result
        th.join()
        await asyncio.sleep(0.01)         # a late duplicate callback must not re-run it
        return fut

    fut = asyncio.run(main())
    assert calls == [1]
    assert fut.t_completed >= fut.t_landed_seen >= fut.t_submit


def test_completion_runs_without_an_awaiter():
    published = []

    async def main():
        p = Poller()
        ev = FakeEvent()
        fut = StreamFuture(ev, completion=lambda: published.append("bits"), poller_=p)
        ev.fire()
        for _ in range(200):
            if fut.done():
                break
            await asyncio.sleep(0.005)
        return fut

    fut = asyncio.run(main())
    assert published == ["bits"] and fut.done()


def test_completion_error_reaches_the_awaiter():
    async def main():
        ev = FakeEvent()
        ev.fire()

        def bad():
            raise LookupError("evicted under the read")
        fut = StreamFuture(ev, completion=bad, poller_=Poller())
        with pytest.raises(LookupError, match="evicted"):
            await fut

    asyncio.run(main())


def test_cancel_before_landing_skips_completion_but_wait_landed_waits_for_the_bytes():
    published = []

    async def main():
        ev = FakeEvent()
        fut = StreamFuture(ev, completion=lambda: published.append(1), poller_=Poller())
        assert fut.cancel() is True
        assert fut.cancel() is False or fut.cancelled()
        t0 = time.perf_counter()
        th = fire_later(ev, 0.05)
        await fut.wait_landed()           # must not return before the event completed
        waited = time.perf_counter() - t0
        th.join()
        with pytest.raises(asyncio.CancelledError):
            await fut
        return waited

    waited = asyncio.run(main())
    assert waited >= 0.045
    assert published == []


def test_cancelled_awaiter_does_not_cancel_the_transfer():
    published = []

    async def main():
        ev = FakeEvent()
        fut = StreamFuture(ev, completion=lambda: published.append(1) or "ok", poller_=Poller())
        waiter = asyncio.ensure_future(_await(fut))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        ev.fire()
        assert await fut == "ok"          # the transfer itself completed and published

    async def _await(f):
        return await f

    asyncio.run(main())
    assert published == [1]


def test_synchronize_completes_inline():
    async def main():
        ev = FakeEvent()
        fut = StreamFuture(ev, completion=lambda: "v", poller_=Poller())
        ev.fire()
        assert fut.synchronize() == "v"
        assert fut.done()

    asyncio.run(main())


def test_wait_stream_orders_a_stream_on_the_event():
    class Stream:
        def __init__(self):
            self.waited = []

        def wait_event(self, ev):
            self.waited.append(ev)

    async def main():
        ev = FakeEvent()
        fut = StreamFuture(ev, poller_=Poller())
        s = Stream()
        fut.wait_stream(s)
        assert s.waited == [ev]
        ev.fire()
        await fut

    asyncio.run(main())


def test_poller_backs_off_and_honours_not_before():
    """A pending future for 150 ms costs at most a few hundred wake-ups (backoff to 200 µs), and
    one that cannot land before 100 ms is not queried before then."""
    async def main():
        p = Poller()
        ev = FakeEvent()
        fut = StreamFuture(ev, poller_=p)
        th = fire_later(ev, 0.15)
        await fut
        th.join()
        wake = p.wakeups
        ev2 = FakeEvent()
        ev2.fire()
        t0 = time.perf_counter()
        fut2 = StreamFuture(ev2, poller_=p, not_before_s=0.1)
        await fut2
        return wake, time.perf_counter() - t0, ev2.queries

    wake, dt, q2 = asyncio.run(main())
    assert wake < 0.15 / 100e-6, wake        # far fewer than one per 100 µs: not spinning
    assert dt >= 0.095 and q2 <= 3


def test_a_transfer_past_its_not_before_is_looked_at_without_backoff():
    """From ``not_before`` until ``due_until`` the poller sleeps ``min_sleep_s`` between looks
    (the transfer is about to land: backing off made a 64 MiB layer's await 365-459 µs late on
    the H100 host); outside that window it backs off as before."""
    async def main():
        p = Poller()
        ev = FakeEvent()
        fut = StreamFuture(ev, poller_=p, not_before_s=0.02)   # due window: 20.0 .. 30.2 ms
        assert fut.due_until == pytest.approx(fut.not_before + 0.01 + 200e-6)
        th = fire_later(ev, 0.028)                              # lands inside it
        await fut
        th.join()
        looks = p.due_looks
        assert looks >= 2 and p.max_due_wait_s == p.min_sleep_s, (looks, p.max_due_wait_s)
        ev2 = FakeEvent()                                       # no hint: never due
        fut2 = StreamFuture(ev2, poller_=p)
        assert fut2.due_until == 0.0
        th = fire_later(ev2, 0.006)
        await fut2
        th.join()
        assert p.due_looks == looks                             # backed off as before
        ev3 = FakeEvent()                                       # lands after its window:
        fut3 = StreamFuture(ev3, poller_=p, not_before_s=0.002)  # 2 .. 3.2 ms
        th = fire_later(ev3, 0.03)
        await fut3
        th.join()
        return p.due_looks - looks, ev3.queries

    late_looks, late_queries = asyncio.run(main())
    # its window's looks, then backoff: far fewer looks than ~28 ms at min_sleep_s would take
    assert late_looks < 1.2e-3 / 20e-6 + 5, late_looks
    assert late_queries < 28e-3 / 100e-6, late_queries


def test_event_loop_stays_responsive_while_futures_are_pending():
    async def main():
        p = Poller()
        evs = [FakeEvent() for _ in range(50)]
        futs = [StreamFuture(e, completion=lambda i=i: i, poller_=p) for i, e in enumerate(evs)]
        ticks = 0
        t_end = time.perf_counter() + 0.05
        while time.perf_counter() < t_end:    # the loop keeps running other work
            await asyncio.sleep(0.001)
            ticks += 1
        for e in evs[::-1]:
            e.fire()
        return ticks, await asyncio.gather(*futs)

    ticks, res = asyncio.run(main())
    assert ticks >= 20
    assert res == list(range(50))


def test_poller_thread_exits_when_idle_and_restarts():
    async def main():
        p = Poller(idle_exit_s=0.05)
        ev = FakeEvent()
        ev.fire()
        await StreamFuture(ev, poller_=p)
        await asyncio.sleep(0.2)
        assert not p.running
        ev2 = FakeEvent()
        ev2.fire()
        await StreamFuture(ev2, poller_=p)
        return p.threads_started

    assert asyncio.run(main()) == 2


def test_query_error_is_reported_through_the_future():
    class Broken(FakeEvent):
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    async def main():
        fut = StreamFuture(Broken(), completion=lambda: "never", poller_=Poller())
        with pytest.raises(RuntimeError, match="illegal"):
            await fut

    asyncio.run(main())


class CountingEvent:
    """Completes at its ``n``-th query (the thread that queries sees it first)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= self.n

    def synchronize(self) -> None:
        self.queries = max(self.queries, self.n)


def test_an_awaiter_spins_on_a_transfer_about_to_land_and_completes_on_its_thread():
    """With a spin budget, ``await`` queries the event on the loop's thread and runs the
    completion there as soon as it lands (no poller round, no wake-up of the loop); the
    poller's later sighting changes nothing (exactly once). A transfer expected later than
    ``SPIN_ADMIT`` of the budget is left to the poller."""
    calls = []

    async def main():
        p = Poller(min_sleep_s=0.05, max_sleep_s=0.05)      # a slow poller: the spin wins
        ev = CountingEvent(200)
        fut = StreamFuture(ev, completion=lambda: calls.append(threading.get_ident()) or 7,
                           poller_=p, spin_ns=50_000_000)
        assert await fut == 7
        assert calls == [threading.get_ident()]
        assert ev.queries >= 200
        late = StreamFuture(FakeEvent(), completion=lambda: 0, poller_=p, spin_ns=1_000_000,
                            not_before_s=10.0)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await late
        assert time.perf_counter() - t0 < 1.0
        late.event.fire()
        await asyncio.sleep(0.1)
        return fut

    fut = asyncio.run(main())
    assert calls and len(calls) == 1
    assert fut.t_completed is not None


def test_a_transfer_due_within_three_quarters_of_the_budget_is_spun_for():
    """``SPIN_ADMIT``: a transfer whose ``not_before`` is 0.6 of the spin budget away (a 64 MiB
    layer on the H100 host: 1.12 of 2 ms) is awaited by the spin, which sees it land (here
    after 50 queries, sooner than ``not_before`` says: the event decides, the hint only admits)
    and completes it on the loop's thread: no poller round (this one would first look at
    ``not_before``, 0.6 s on), no wake-up of the loop. At half the budget, such a layer was left
    to the poller: 240-300 µs late on the H100 host."""
    async def main():
        p = Poller(min_sleep_s=0.05, max_sleep_s=0.05)
        ev = CountingEvent(50)
        budget_s = 1.0
        fut = StreamFuture(ev, completion=lambda: 9, poller_=p, spin_ns=int(budget_s * 1e9),
                           not_before_s=0.6 * budget_s)
        t0 = time.perf_counter()
        got = await fut
        return got, time.perf_counter() - t0, p.resolved, ev.queries

    got, dt, resolved, queries = asyncio.run(main())
    assert got == 9 and resolved == 0 and queries >= 50, (got, resolved, queries)
    assert dt < 0.3, dt                    # not the poller's look at not_before (0.6 s)


def test_an_awaiter_naps_until_shortly_before_a_later_landing_then_spins():
    """``NAP_MAX_S``: a transfer due beyond the spin's admission but within the nap bound (a
    whole prompt: 7.45 ms) is awaited by letting the loop run until half the budget before its
    expected landing, then spinning: it completes on the loop's thread, with no poller round
    (this poller would look once every 0.2 s: 50 queries would take it 10 s) and no wake-up
    through the loop. A transfer due later than the bound is left to the poller.

    Robust to a stalled test process (CI, two cores, three xdist workers: a nap scheduled 3 ms
    after the future's submission once missed its tick, which a stall of 5 ms between submit
    and await does, as the spin then admits the transfer at once): the poller's thread runs
    before the future is submitted (its start, under load, took that long), the collector is
    off, the transfer is due just inside the bound with a short budget (a stall of ~10 ms before
    the await still leaves a nap), and the tick is the loop's next step after the awaiter
    yields, which it does only to nap."""
    async def main():
        p = Poller(min_sleep_s=0.2, max_sleep_s=0.2)
        warm = StreamFuture(FakeEvent(), completion=lambda: 0, poller_=p)
        warm.event.fire()
        assert await warm == 0 and p.running
        ev = CountingEvent(50)
        budget_s = 0.001
        not_before_s = NAP_MAX_S - 0.0005
        ticks: list[int] = []
        fut = StreamFuture(ev, completion=lambda: 21, poller_=p, spin_ns=int(budget_s * 1e9),
                           not_before_s=not_before_s)
        asyncio.get_running_loop().call_soon(ticks.append, 1)   # runs only if the awaiter yields
        async with asyncio.timeout(1.0):
            got = await fut
        dt = time.perf_counter() - fut.t_submit
        resolved = p.resolved
        assert ticks == [1]                   # the loop ran while the awaiter napped
        far = StreamFuture(FakeEvent(), completion=lambda: 0, poller_=p, spin_ns=4_000_000,
                           not_before_s=10 * NAP_MAX_S)
        nap_far = far._nap_s()
        far.event.fire()
        return got, dt, resolved, nap_far

    gc.disable()
    try:
        got, dt, resolved, nap_far = asyncio.run(main())
    finally:
        gc.enable()
    assert got == 21 and resolved == 1, (got, resolved)     # the warm-up future's alone
    assert 0.005 <= dt < 0.5, dt          # napped (the loop ran), then spun; not the poller
                                          # (from the submission: a stall counts toward the nap)
    assert nap_far == 0.0


def test_a_cancelled_napping_awaiter_leaves_the_completion_to_the_poller():
    """Cancelling the task that naps before its spin does not cancel the transfer: the poller
    still completes it, once."""
    calls = []

    async def main():
        p = Poller()
        ev = FakeEvent()
        fut = StreamFuture(ev, completion=lambda: calls.append(1) or 5, poller_=p,
                           spin_ns=2_000_000, not_before_s=0.008)
        task = asyncio.ensure_future(_await(fut))
        await asyncio.sleep(0.002)          # napping now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ev.fire()
        for _ in range(200):
            if fut.done():
                break
            await asyncio.sleep(0.005)
        return fut

    fut = asyncio.run(main())
    assert calls == [1] and fut.result() == 5 and not fut.cancelled()


async def _await(fut: StreamFuture) -> object:
    return await fut


def test_a_spin_that_runs_out_leaves_the_completion_to_the_poller():
    async def main():
        p = Poller()
        ev = FakeEvent()
        fut = StreamFuture(ev, completion=lambda: 5, poller_=p, spin_ns=2_000_000)
        th = fire_later(ev, 0.05)
        t0 = time.perf_counter()
        assert await fut == 5                 # the spin gave up after 2 ms; the poller ended it
        assert time.perf_counter() - t0 >= 0.04
        th.join()
    asyncio.run(main())


class ReleasingEvent(CountingEvent):
    """A pooled event (``cuda/events.py``): lands after ``n`` queries, counts its releases."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_a_spun_transfer_makes_no_asyncio_future_and_hands_its_event_back_once():
    """The common case of a layer-streamed request: the awaiter's spin sees the transfer land,
    the completion runs inline and ``await`` returns without any asyncio future made; a pooled
    event goes back to its pool exactly once and the future keeps the DONE sentinel (a later
    ``wait_stream`` or ``synchronize`` waits for nothing)."""
    async def main():
        p = Poller(min_sleep_s=0.05, max_sleep_s=0.05)
        ev = ReleasingEvent(50)
        fut = StreamFuture(ev, completion=lambda: 11, poller_=p, spin_ns=50_000_000)
        assert await fut == 11
        assert fut._result_fut is None and fut._landed_fut is None
        assert ev.released == 1 and fut.event.query()
        fut._on_landed()                      # the poller's late sighting changes nothing
        assert ev.released == 1
        await fut.wait_landed()               # landed: returns at once
        assert fut.seen_landed and fut.done() and fut.result() == 11 and not fut.cancel()
        await asyncio.sleep(0.12)             # the slow poller sees it too: still once
        assert ev.released == 1

    asyncio.run(main())


class LoopSeesItEvent:
    """Landed for queries from the thread that made it (the loop's); never for another."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()

    def query(self) -> bool:
        return threading.get_ident() == self.owner

    def synchronize(self) -> None:
        pass


def test_the_poller_drops_a_spun_transfer_without_calling_into_the_loop():
    """A transfer its awaiter saw land (the spin) is dropped by the poller's next round: no
    ``call_soon_threadsafe`` (a self-pipe write and a wake-up of the loop, per layer
    operation), counted as ``skipped``; one the poller sees first still goes through the loop."""
    async def main():
        p = Poller(min_sleep_s=0.02, max_sleep_s=0.02)
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            calls.append(getattr(cb, "__name__", repr(cb)))
            return real(cb, *args, **kw)
        loop.call_soon_threadsafe = counting          # type: ignore[method-assign]
        try:
            ev = LoopSeesItEvent()                    # the poller cannot see it land
            fut = StreamFuture(ev, completion=lambda: 3, poller_=p, spin_ns=50_000_000)
            assert await fut == 3                     # the spin saw it land
            for _ in range(200):                      # the poller's next round drops it
                if p.skipped:
                    break
                await asyncio.sleep(0.005)
            assert p.skipped == 1 and p.outstanding == 0
            assert "_on_landed" not in calls, calls
            ev2 = FakeEvent()
            fut2 = StreamFuture(ev2, completion=lambda: 4, poller_=p)
            ev2.fire()
            assert await fut2 == 4                     # no spin: the poller resolved it
            assert calls.count("_on_landed") == 1
            for _ in range(200):                      # (its counter follows the call)
                if p.resolved:
                    break
                await asyncio.sleep(0.005)
            assert p.resolved == 1 and p.skipped == 1
        finally:
            del loop.call_soon_threadsafe
    asyncio.run(main())


def test_result_states_without_and_with_an_awaiter():
    """``result()`` before the completion raises InvalidStateError; an error of a completion
    nobody awaited is raised by ``result()`` and by a later ``await`` (its asyncio future is
    made then, already failed); a cancelled transfer raises CancelledError to a later awaiter."""
    async def main():
        p = Poller()
        ev = FakeEvent()

        def boom() -> None:
            raise ValueError("validation failed")

        fut = StreamFuture(ev, completion=boom, poller_=p)
        with pytest.raises(asyncio.InvalidStateError):
            fut.result()
        ev.fire()
        await fut.wait_landed()
        with pytest.raises(ValueError):
            fut.result()
        with pytest.raises(ValueError):
            await fut
        ev2 = FakeEvent()
        fut2 = StreamFuture(ev2, completion=lambda: 1, poller_=p)
        assert fut2.cancel() and fut2.cancelled()
        with pytest.raises(asyncio.CancelledError):
            await fut2
        ev2.fire()
        await fut2.wait_landed()
        assert fut2.seen_landed and fut2.cancelled()

    asyncio.run(main())


def test_futures_added_around_the_pollers_idle_exit_all_resolve():
    """``Poller.add`` takes no lock while the poller polls; the poller exits after
    ``idle_exit_s`` with nothing to watch, and the next add starts it again. Futures added just
    before, during and after those exits (timings spread over the exit window) must all be
    resolved by the poller (no spin): a lost one would hang its await."""
    import random

    async def main():
        p = Poller(idle_exit_s=0.002)
        rng = random.Random(7)
        for i in range(300):
            await asyncio.sleep(rng.choice((0.0, 0.0005, 0.0015, 0.002, 0.0025, 0.004)))
            evs = [FakeEvent() for _ in range(rng.randint(1, 3))]
            for ev in evs:
                ev.fire()
            futs = [StreamFuture(ev, completion=lambda i=i: i, poller_=p) for ev in evs]
            got = await asyncio.wait_for(asyncio.gather(*futs), 2.0)
            assert got == [i] * len(evs)
        return p

    p = asyncio.run(main())
    assert p.resolved >= 300 and p.threads_started > 10, (p.resolved, p.threads_started)
    assert p.outstanding == 0


def test_an_idle_poller_is_woken_by_the_next_future():
    """A poller waiting idle (nothing outstanding, its thread alive for ``idle_exit_s``) is woken
    by the next future's ``add`` at once, not at the end of its idle wait."""
    async def main():
        p = Poller(idle_exit_s=5.0)
        ev = FakeEvent()
        ev.fire()
        assert await StreamFuture(ev, completion=lambda: 1, poller_=p) == 1
        await asyncio.sleep(0.05)               # the poller has dropped it and waits idle
        assert p.running and p.outstanding == 0
        waits = []
        for i in range(5):
            ev2 = FakeEvent()
            ev2.fire()
            t0 = time.perf_counter()
            async with asyncio.timeout(1.0):
                assert await StreamFuture(ev2, completion=lambda i=i: i, poller_=p) == i
            waits.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)           # idle again
        return p, waits

    p, waits = asyncio.run(main())
    assert p.threads_started == 1 and max(waits) < 0.5, (p.threads_started, waits)


class _FixedClock:
    """``time`` for the futures module with ``perf_counter`` held at ``fixed`` (when set): a
    nap's arithmetic checked without the machine's stalls in it."""

    def __init__(self) -> None:
        self.fixed: float | None = None

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(time, name)

    def perf_counter(self) -> float:
        return time.perf_counter() if self.fixed is None else self.fixed


def test_a_transfer_enqueued_before_its_future_naps_from_its_first_enqueue(monkeypatch):
    """A future made after its transfer's first enqueue (``t_submit``: a caller that enqueues
    in parts) naps and sets ``not_before`` from that enqueue, so an awaiter does not sleep past
    a landing that began earlier. The clock is held still:
    under load a stall between the futures' creation and the look made both naps 0 (CI)."""
    from tract_async.cuda import futures as F
    clock = _FixedClock()
    monkeypatch.setattr(F, "time", clock)

    async def main():
        ev = FakeEvent()
        t0 = clock.fixed = 100.0
        early = StreamFuture(ev, not_before_s=0.008, poller_=Poller(), t_submit=t0 - 0.006)
        late = StreamFuture(ev, not_before_s=0.008, poller_=Poller())
        assert early.t_submit == t0 - 0.006
        assert early.not_before == pytest.approx(t0 + 0.002)
        assert late.not_before >= t0 + 0.008
        assert early._nap_s() == pytest.approx(t0 - 0.006 + 0.008 * F.LAND_SLACK - t0)
        assert late._nap_s() == pytest.approx(0.008 * F.LAND_SLACK)
        assert early._nap_s() < late._nap_s() - 0.004
        clock.fixed = None
        ev.fire()
        await early
        await late

    asyncio.run(main())
