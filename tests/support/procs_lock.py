"""Worker processes for the lock, allocator and recovery tests (spawned: importable, no fork).

Every worker is a node: it attaches, joins its node id, heartbeats, runs a LockManager candidate
in its TaskGroup (as an engine does) and reports to the test through a multiprocessing queue.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
import traceback

import numpy as np
from numba import njit

import tract_kernels as K
from tract_kernels.intrinsics import usleep
from tract_async.region import Region, SectionSpec
from tract_async.region.alloc import Allocation, Allocator, sections_for
from tract_async.sync import GlobalLock, LockManager, PollPolicy, heartbeat_forever

S_CTR_READ = K.site("test.counter.invalidate")
S_CTR_WRITE = K.site("test.counter.flush")
S_STAMP = K.site("test.stamp")

COUNTER_SECTION = "test.counter"


@njit(cache=True, nogil=True)
def increment(m, counter_off, cs_us):
    """The critical section: read the counter fresh, wait ``cs_us`` (widens the race), +1."""
    v = K.load_fresh(m, counter_off, S_CTR_READ)
    if cs_us > 0:
        usleep(cs_us)
    K.store_flush(m, counter_off, v + np.uint64(1), S_CTR_WRITE)


@njit(cache=True, nogil=True)
def sleep_us(micros):
    """usleep callable from Python (the raw intrinsic is only usable inside jitted code)."""
    usleep(micros)


def make_region(path: str, backend: str, *, size_bytes: int = 16 << 20, max_nodes: int = 6,
                chunk_bytes: int = 1 << 20, min_slot_bytes: int = 4096,
                evict_prob: float = 1 / 64) -> Region:
    """A region laid out as an engine would, plus a one-page counter section for the tests."""
    secs = sections_for(size_bytes, max_nodes, chunk_bytes, min_slot_bytes=min_slot_bytes)
    secs.insert(-1, SectionSpec(name=COUNTER_SECTION, nbytes=4096))
    return Region.create(path, size_bytes, max_nodes=max_nodes, sections=secs, backend=backend,
                         sim_evict_prob=evict_prob)


def attach(path: str, backend: str, node_id: int, evict_prob: float, skip_site: int) -> Region:
    r = Region.attach(path, backend=backend, sim_seed=node_id * 7 + 1, sim_evict_prob=evict_prob)
    if skip_site >= 0:
        r.mem = K.with_skip_site(r.mem, skip_site)
    return r


def _bwait(barrier, timeout: float = 120.0) -> None:  # noqa: ANN001
    barrier.wait(timeout)


async def _node_services(r: Region, h, liveness_s: float, tg: asyncio.TaskGroup,  # noqa: ANN001
                         manager: bool = True) -> list[asyncio.Task]:
    tasks = [tg.create_task(heartbeat_forever(r, h, interval_s=liveness_s / 8))]
    if manager:
        tasks.append(tg.create_task(LockManager(r, h, liveness_timeout_s=liveness_s).run()))
    return tasks



def collect_reports(procs: list, q, n: int, timeout_s: float, barriers: tuple = (),  # noqa: ANN001
                    kind_wanted: str | None = None) -> list:
    """Read ``n`` reports from ``q`` (only those of ``kind_wanted``, when given); an "error"
    report aborts ``barriers`` and fails. Always reaps the workers (killing stragglers)."""
    reports = []
    try:
        while len(reports) < n:
            kind, node, payload = q.get(timeout=timeout_s)
            if kind == "error":
                for b in barriers:
                    b.abort()
                raise AssertionError(f"node {node} failed: {payload}")
            if kind_wanted is None or kind == kind_wanted:
                reports.append(payload)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    return reports

# ---- mutual exclusion --------------------------------------------------------------------------

def counter_worker(path: str, backend: str, node_id: int, cycles: int, use_lock: bool,
                   skip_site: int, start, done, q, liveness_s: float, cs_us: int,  # noqa: ANN001
                   evict_prob: float, acquire_timeout_s: float) -> None:
    r = attach(path, backend, node_id, evict_prob, skip_site)
    try:
        h = r.nodes.join(node_id, timeout_s=liveness_s)
        asyncio.run(_counter(r, h, node_id, cycles, use_lock, start, done, q, liveness_s, cs_us,
                             acquire_timeout_s))
    except BaseException as e:  # report, never hang the test
        q.put(("error", node_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        r.close()


async def _counter(r: Region, h, node_id: int, cycles: int, use_lock: bool, start, done,  # noqa: ANN001
                   q, liveness_s: float, cs_us: int, acquire_timeout_s: float) -> None:
    ctr = r.section(COUNTER_SECTION).offset_bytes
    m = r.mem
    lock = GlobalLock(r, h)
    errors: list[str] = []
    async with asyncio.TaskGroup() as tg:
        services = await _node_services(r, h, liveness_s, tg, manager=use_lock)
        await asyncio.to_thread(_bwait, start)
        t0 = time.monotonic()
        for _ in range(cycles):
            try:
                if use_lock:
                    await lock.acquire(timeout=acquire_timeout_s)
                    lock.check_token()
                increment(m, ctr, cs_us)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}")
                if lock.held:
                    lock.release()
                break
            if use_lock:
                lock.release()
        elapsed = time.monotonic() - t0
        st = lock.statistics()
        q.put(("done", node_id, {"errors": errors, "elapsed": elapsed,
                                 "p50": st.wait_p50_s, "p99": st.wait_p99_s}))
        await asyncio.to_thread(_bwait, done)   # keep managing until every node is through
        for t in services:
            t.cancel()
    lock.close()


# ---- allocator stress ----------------------------------------------------------------------------

def alloc_worker(path: str, backend: str, node_id: int, budget: float | int, start, done,  # noqa: ANN001
                 q, inbox, outboxes, liveness_s: float, seed: int, use_lock: bool,
                 claim_delay_us: int) -> None:
    """``budget``: a float is seconds of wall time (the long form), an int a count of operations
    (alloc, hand-over or free: the CI form, which does the same work on a slow or loaded machine)."""
    r = attach(path, backend, node_id, 1 / 256, -1)
    try:
        h = r.nodes.join(node_id, timeout_s=liveness_s)
        asyncio.run(_alloc(r, h, node_id, budget, start, done, q, inbox, outboxes, liveness_s,
                           seed, use_lock, claim_delay_us))
    except BaseException as e:
        q.put(("error", node_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        r.close()


class _NoLock:
    """Negative control: looks like a GlobalLock, excludes nobody."""
    token = 1

    async def acquire(self, timeout: float | None = None) -> int:
        return 1

    def release(self) -> None:
        pass

    def check_token(self) -> None:
        pass


def _stamp(m, a: Allocation, node_id: int, serial: int) -> None:  # noqa: ANN001
    """Write the owner stamp into the first and the last word of the slot."""
    word = np.array([(node_id + 1) << 48 | serial], dtype=np.uint64)
    K.write_bytes(m, a.offset_bytes, word.ctypes.data, 8, S_STAMP)
    K.write_bytes(m, a.offset_bytes + a.nbytes - a.nbytes % 8 - 8 if a.nbytes >= 16 else
                  a.offset_bytes, word.ctypes.data, 8, S_STAMP)


def _read_stamp(m, a: Allocation) -> tuple[int, int]:  # noqa: ANN001
    out = np.zeros(2, dtype=np.uint64)
    K.read_bytes(m, a.offset_bytes, out.ctypes.data, 8, S_STAMP)
    K.read_bytes(m, a.offset_bytes + a.nbytes - a.nbytes % 8 - 8 if a.nbytes >= 16 else
                 a.offset_bytes, out[1:].ctypes.data, 8, S_STAMP)
    return int(out[0]), int(out[1])


async def _alloc(r: Region, h, node_id: int, budget: float | int, start, done, q, inbox,  # noqa: ANN001
                 outboxes, liveness_s: float, seed: int, use_lock: bool,
                 claim_delay_us: int) -> None:
    rng = random.Random(seed * 1000 + node_id)
    hook = (lambda point: sleep_us(claim_delay_us) if point == "claim.found" else None) \
        if claim_delay_us else None
    al = Allocator(r, h, keep_free_chunks=0, liveness_timeout_s=liveness_s, fault_hook=hook)
    lock = GlobalLock(r, h) if use_lock else _NoLock()
    m = r.mem
    held: dict[int, tuple[Allocation, int]] = {}
    violations: list[str] = []
    counts = {"allocs": 0, "frees": 0, "foreign_frees": 0, "full": 0, "sent": 0}
    serial = 0
    sizes = [3000, 4096, 6000, 20000, 65536, 200000]

    def check_and_free(a: Allocation, stamp: int) -> None:
        got = _read_stamp(m, a)
        if got != (stamp, stamp):
            violations.append(f"slot {a.offset_bytes} stamped {got[0]:#x}/{got[1]:#x}, "
                              f"expected {stamp:#x}: held by two owners")
        al.free(a)

    async with asyncio.TaskGroup() as tg:
        services = await _node_services(r, h, liveness_s, tg, manager=use_lock)
        await asyncio.to_thread(_bwait, start)
        by_count = isinstance(budget, int)
        end = time.monotonic() + (0 if by_count else budget)
        ops = 0
        while (ops < budget if by_count else time.monotonic() < end) and not violations:
            ops += 1
            # slots handed over by other nodes: check their stamp, free them (through the rings)
            while not inbox.empty():
                a, stamp = inbox.get_nowait()
                check_and_free(a, stamp)
                counts["foreign_frees"] += 1
            op = rng.random()
            if op < 0.55 or not held:
                try:
                    a = await al.alloc(rng.choice(sizes), lock, timeout=10)
                except Exception as e:  # noqa: BLE001
                    if type(e).__name__ == "RegionFull":
                        counts["full"] += 1
                        for k in list(held)[: len(held) // 2]:
                            check_and_free(*held.pop(k))
                        continue
                    raise
                serial += 1
                stamp = (node_id + 1) << 48 | serial
                _stamp(m, a, node_id, serial)
                held[a.offset_bytes] = (a, stamp)
                counts["allocs"] += 1
            elif op < 0.7 and outboxes:
                k = rng.choice(list(held))
                a, stamp = held.pop(k)
                rng.choice(outboxes).put((a, stamp))
                counts["sent"] += 1
            else:
                k = rng.choice(list(held))
                check_and_free(*held.pop(k))
                counts["frees"] += 1
            if rng.random() < 0.02:
                await asyncio.sleep(0)
        for a, stamp in held.values():
            check_and_free(a, stamp)
        q.put(("stopped", node_id, 0))
        await asyncio.to_thread(_bwait, start)   # everyone stopped sending
        while not inbox.empty():
            a, stamp = inbox.get_nowait()
            check_and_free(a, stamp)
            counts["foreign_frees"] += 1
        await asyncio.to_thread(_bwait, start)   # everyone pushed its returns
        al.drain_returns()
        problems = al.self_check()
        released = await al.close(lock, timeout=10) if use_lock else 0
        st = al.statistics()
        counts["ops"] = ops
        q.put(("done", node_id, {"violations": violations, "problems": problems,
                                 "counts": counts, "released": released,
                                 "left_used": st.slots_used, "left_chunks": st.chunks,
                                 "dropped": st.returns_dropped, "pending": st.returns_pending}))
        await asyncio.to_thread(_bwait, done)
        for t in services:
            t.cancel()
    if isinstance(lock, GlobalLock):
        lock.close()


# ---- crash scenarios ------------------------------------------------------------------------

async def _poll_event(ev, timeout_s: float = 120.0) -> None:  # noqa: ANN001
    """Wait for a multiprocessing Event by polling: a process killed inside Event.wait() would
    leave the Event's condition waiting for it forever (set() then hangs)."""
    end = time.monotonic() + timeout_s
    while not ev.is_set() and time.monotonic() < end:
        await asyncio.sleep(0.02)


def crash_worker(path: str, backend: str, node_id: int, role: str, q, liveness_s: float,  # noqa: ANN001
                 manager: bool, go, stop, kill_at=None, bound_s: float = 2.0) -> None:  # noqa: ANN001
    """Roles: 'serve' (heartbeat and manager candidate until ``stop``), 'hold' (acquire, then
    hang), 'claim' (hang inside a chunk claim), 'survivor' (works from "ready" through the
    kill, ``_work_through_kill``; after ``go``: acquire, recover, allocate, report, free,
    close). Hung ones are killed by the test with SIGKILL. ``kill_at``: a shared double the
    test sets to the monotonic time of its kill (0 before)."""
    r = attach(path, backend, node_id, 1 / 256, -1)
    try:
        h = r.nodes.join(node_id, timeout_s=liveness_s)
        asyncio.run(_crash(r, h, node_id, role, q, liveness_s, manager, go, stop, kill_at,
                           bound_s))
    except BaseException as e:
        q.put(("error", node_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        r.close()


async def _work_through_kill(r: Region, al: Allocator, lock: GlobalLock, node_id: int,  # noqa: ANN001
                            kill_at, bound_s: float) -> dict:
    """A survivor's work while another node is killed: operations back to back, each timed
    (monotonic, comparable with the test's clock), until one that started ``bound_s`` after
    the kill has completed. One operation: take the global lock and run recovery
    (``recover_locked``: what it did is kept), then allocate a slot (a chunk claim when none
    is free), write a word naming this node and operation into it, read it back after a
    moment (another node handed the same slot would overwrite it: a wrong word), free it.
    Returns the operations' (start, end), the recovery done and the wrong words."""
    ops: list[tuple[float, float]] = []
    recovery: list[str] = []
    wrong = 0
    word, back = np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64)
    give_up = time.monotonic() + 120
    i = 0
    while True:
        t0 = time.monotonic()
        await lock.acquire(timeout=30)
        try:
            recovery += al.recover_locked(lock)
        finally:
            lock.release()
        a = await al.alloc(5000, lock, timeout=30)
        word[0] = node_id << 48 | i
        K.write_bytes(r.mem, a.offset_bytes, word.ctypes.data, 8, S_STAMP)
        await asyncio.sleep(0.002)
        K.read_bytes(r.mem, a.offset_bytes, back.ctypes.data, 8, S_STAMP)
        wrong += int(back[0] != word[0])
        al.free(a)
        ops.append((t0, time.monotonic()))
        i += 1
        k = kill_at.value if kill_at is not None else 0.0
        if (k and t0 > k + bound_s) or kill_at is None:
            break
        if time.monotonic() > give_up:
            raise AssertionError("no kill within 120 s of the survivor's start")
        await asyncio.sleep(0.005)
    return {"ops": ops, "recovery": recovery, "wrong": wrong}


async def _crash(r: Region, h, node_id: int, role: str, q, liveness_s: float,  # noqa: ANN001
                 manager: bool, go, stop, kill_at=None, bound_s: float = 2.0) -> None:  # noqa: ANN001
    from tract_async.sync import read_manager

    def hang_in_claim(point: str) -> None:
        if role == "claim" and point == "claim.owner":
            q.put(("in-claim", node_id, os.getpid()))
            time.sleep(600)   # killed here: journal PENDING, owner record written, bit not

    al = Allocator(r, h, liveness_timeout_s=liveness_s, fault_hook=hang_in_claim)
    lock = GlobalLock(r, h, policy=PollPolicy(slice_s=0.005))
    async with asyncio.TaskGroup() as tg:
        services = await _node_services(r, h, liveness_s, tg, manager=manager)
        if role == "serve":
            while read_manager(r).node_id is None:
                await asyncio.sleep(0.01)
            q.put(("serving", node_id, read_manager(r).node_id))
            await _poll_event(stop)
        elif role == "hold":
            a = await al.alloc(5000, lock, timeout=30)
            await lock.acquire(timeout=30)
            q.put(("holding", node_id, a.offset_bytes))
            await asyncio.sleep(600)
        elif role == "claim":
            await al.alloc(5000, lock, timeout=30)   # hangs in the hook
        elif role == "survivor":
            q.put(("ready", node_id, 0))
            work = await _work_through_kill(r, al, lock, node_id, kill_at, bound_s)
            await _poll_event(go)
            token = await lock.acquire(timeout=30)
            acquired_at = time.monotonic()
            lock.release()
            done = work["recovery"] + await al.recover(lock, timeout=30)
            a = await al.alloc(5000, lock, timeout=30)
            b = await al.alloc(5000, lock, timeout=30)
            q.put(("survived", node_id, {"acquired_at": acquired_at, "token": token,
                                         "recovery": done,
                                         "allocs": [a.offset_bytes, b.offset_bytes],
                                         "chunks": al.owned_chunks(),
                                         "revocations": lock.statistics().revocations,
                                         "ops": work["ops"], "wrong": work["wrong"]}))
            await _poll_event(stop)
            al.free(a)
            al.free(b)
            await al.close(lock, timeout=30)
        for t in services:
            t.cancel()
    lock.close()
