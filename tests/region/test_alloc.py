"""Two-tier allocator: single-node behaviour, and a multi-process stress with owner stamps,
cross-node frees through the return rings, and fsck at the end (with a no-lock negative
control)."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
from typing import AsyncIterator

import numpy as np
import pytest

import tract_kernels as K

from tract_async import errors as E
from tract_async.region.alloc import Allocation, Allocator, allocations_of_rows, sections_for
from tract_async.tools.fsck import run_fsck
from tract_async.sync import GlobalLock, LockManager, heartbeat_forever
from tests.support import procs_lock as P

SPAWN = mp.get_context("spawn")
LIVENESS_S = 1.0


@contextlib.asynccontextmanager
async def node_services(r, h) -> AsyncIterator[None]:  # noqa: ANN001
    """This node's heartbeat and a lock manager, running for the duration of the block."""
    async with asyncio.TaskGroup() as tg:
        beat = tg.create_task(heartbeat_forever(r, h, interval_s=0.1))
        run = tg.create_task(LockManager(r, h, liveness_timeout_s=LIVENESS_S).run())
        try:
            yield
        finally:
            beat.cancel()
            run.cancel()


STRESS_OPS = 3000
"""Operations per node in the CI form of the stress (alloc, hand-over or free): a count, so that
a slow or loaded machine does the same work, not less. The long form (``slow``) runs 20 s."""


def run_stress(path: str, backend: str, budget: float | int, *, use_lock: bool = True,
               claim_delay_us: int = 0, size_bytes: int = 24 << 20,
               chunk_bytes: int = 1 << 20) -> list[dict]:
    P.make_region(path, backend, size_bytes=size_bytes, chunk_bytes=chunk_bytes).close()
    n = 4
    start, done = SPAWN.Barrier(n), SPAWN.Barrier(n)
    q = SPAWN.Queue()
    inboxes = [SPAWN.Queue() for _ in range(n)]
    procs = [SPAWN.Process(target=P.alloc_worker,
                           args=(path, backend, i, budget, start, done, q, inboxes[i],
                                 [inboxes[j] for j in range(n) if j != i], LIVENESS_S, 7,
                                 use_lock, claim_delay_us))
             for i in range(n)]
    for p in procs:
        p.start()
    timeout_s = 300.0 if isinstance(budget, int) else budget + 240
    return P.collect_reports(procs, q, n, timeout_s, (start, done), kind_wanted="done")


def _assert_clean_run(path: str, reports: list[dict]) -> None:
    for r in reports:
        assert not r["violations"], r["violations"][:5]
        assert not r["problems"], r["problems"][:5]
        assert r["left_used"] == 0 and r["left_chunks"] == 0 and r["pending"] == 0, r
    assert sum(r["counts"]["allocs"] for r in reports) > 100
    assert sum(r["counts"]["foreign_frees"] for r in reports) > 10   # the rings were used
    rep = run_fsck(path, liveness_timeout_s=LIVENESS_S)
    assert rep.clean, rep.text()
    assert not any(s.startswith("node ") for s in rep.summary), rep.text()  # zero leaks


@pytest.mark.parametrize("backend", ["hw", "sim"])
def test_alloc_stress(region_path: str, backend: str) -> None:
    """The acceptance stress in every CI run: 4 nodes, STRESS_OPS operations each, per backend."""
    reports = run_stress(region_path, backend, STRESS_OPS)
    _assert_clean_run(region_path, reports)
    assert all(r["counts"]["ops"] == STRESS_OPS for r in reports), reports


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hw", "sim"])
def test_alloc_stress_20s(region_path: str, backend: str) -> None:
    """The long form: 4 nodes, 20 s per backend."""
    _assert_clean_run(region_path, run_stress(region_path, backend, 20.0))


@pytest.mark.fsck_dirty   # the unlocked run leaves chunks of its killed workers behind, on purpose
def test_alloc_negative_control_without_lock(region_path: str) -> None:
    """Chunk claims without the global lock (and a widened claim window) hand one chunk to two
    nodes: the owner stamps or fsck must catch it, so that the clean runs above mean something.
    The same operation count as the CI form (it ran 3 s before: ~3,500 operations a node)."""
    try:
        reports = run_stress(region_path, "hw", STRESS_OPS, use_lock=False, claim_delay_us=300,
                             size_bytes=12 << 20)
    except AssertionError as e:           # a node tripped over the damage: must be the allocator
        # AllocationInvalid: a slot freed twice; NodeEvicted: unlocked writers of the packed
        # per-node records garbled a reclaimed-epoch word; both are damage the lock prevents
        assert any(k in str(e) for k in ("AllocationInvalid", "allocator:", "NodeEvicted")), e
        return
    caught = any(r["violations"] or r["problems"] for r in reports) or \
        not run_fsck(region_path, liveness_timeout_s=LIVENESS_S).clean
    assert caught, "claims without the lock were never caught: the stress test proves nothing"


# ---- single node ----------------------------------------------------------------------------

async def test_alloc_free_classes_full_and_close(region_path: str, backend: str) -> None:
    r = P.make_region(region_path, backend, size_bytes=8 << 20, chunk_bytes=1 << 20)
    try:
        h = r.nodes.join(0, timeout_s=LIVENESS_S)
        al = Allocator(r, h, liveness_timeout_s=LIVENESS_S, keep_free_chunks=0)
        lock = GlobalLock(r, h)
        assert al.alloc_nowait(4096) is None            # no chunk yet: never blocks
        with pytest.raises(E.AllocationTooLarge):
            al.class_for((1 << 20) + 1)
        async with node_services(r, h):
            a = await al.alloc(3000, lock, timeout=10)
            assert a.slot_bytes == 4096 and a.owner_node == 0 and a.token >> 32 == 1
            b = al.alloc_nowait(4000)                   # same chunk, from the free list
            assert b is not None and b.chunk_index == a.chunk_index and b.offset_bytes != a.offset_bytes
            big = await al.alloc(1 << 20, lock, timeout=10)
            assert big.slot_bytes == 1 << 20 and big.chunk_index != a.chunk_index
            al.free(b)
            with pytest.raises(E.AllocationInvalid):
                al.free(b)                              # double free
            held = [a, big]
            with pytest.raises(E.RegionFull):
                while True:
                    held.append(await al.alloc(1 << 20, lock, timeout=10))
            assert al.self_check() == []
            rep = run_fsck(region_path, liveness_timeout_s=LIVENESS_S)
            assert rep.clean, rep.text()
            for x in held:
                al.free(x)
            assert await al.close(lock, timeout=10) == len(held)
            assert al.statistics().chunks == 0
        lock.close()
    finally:
        r.close()
    rep = run_fsck(region_path, liveness_timeout_s=LIVENESS_S)
    assert rep.clean, rep.text()


def test_sections_for_validates() -> None:
    with pytest.raises(ValueError):
        sections_for(1 << 30, 8, chunk_bytes=3 << 20)
    with pytest.raises(ValueError):
        sections_for(1 << 30, 8, min_slot_bytes=32)
    names = [s.name for s in sections_for(1 << 30, 8)]
    assert names[0] == "sync.locks" and names[-1] == "alloc.chunks"


def test_custom_size_classes(region_path: str) -> None:
    r = P.make_region(region_path, "hw", size_bytes=8 << 20, chunk_bytes=1 << 20)
    try:
        h = r.nodes.join(0, timeout_s=LIVENESS_S)
        al = Allocator(r, h, size_classes=[96 << 10, 1 << 20])
        assert al.class_for(70000) == 96 << 10 and al.class_for(100 << 10) == 1 << 20
        with pytest.raises(ValueError):
            Allocator(r, h, size_classes=[100])
    finally:
        r.close()


async def test_large_batches_alloc_and_free_on_arrays(region_path: str, backend: str) -> None:
    """Batches above SMALL_BATCH take the array paths (``_set_bits``, ``_free_many_local``):
    slots across several chunks, the heap bitmap in the region matching, a double free or a
    slot given twice refused with nothing changed, fsck clean."""
    from tract_async.region.alloc import SMALL_BATCH
    r = P.make_region(region_path, backend, size_bytes=8 << 20, chunk_bytes=1 << 20)
    try:
        h = r.nodes.join(0, timeout_s=LIVENESS_S)
        al = Allocator(r, h, liveness_timeout_s=LIVENESS_S, keep_free_chunks=0)
        lock = GlobalLock(r, h)
        n = 3 * 16 + 5                                   # 64 KiB slots: 16 per 1 MiB chunk
        assert n > SMALL_BATCH
        async with node_services(r, h):
            await lock.acquire(timeout=10)
            try:
                got = al.alloc_many_locked(64 << 10, n, lock)
            finally:
                lock.release()
            assert len(got) == n and len({a.offset_bytes for a in got}) == n
            assert len({a.chunk_index for a in got}) == 4
            assert al.self_check() == []
            half, rest = got[: n // 2], got[n // 2:]
            assert al.free_many(half) == [True] * len(half)
            assert al.self_check() == []
            with pytest.raises(E.AllocationInvalid, match="not allocated"):
                al.free_many(half[:SMALL_BATCH] + rest[:SMALL_BATCH])   # half of it freed already
            with pytest.raises(E.AllocationInvalid, match="twice"):
                al.free_many(rest[:SMALL_BATCH] + rest[:1])
            assert al.self_check() == []                 # the refused batches changed nothing
            again = al.alloc_many_nowait(64 << 10, len(half))
            assert sorted(a.offset_bytes for a in again) == sorted(a.offset_bytes for a in half)
            assert al.free_many(rest + again) == [True] * n
            assert al.self_check() == []
            # the same slots as numpy rows (a large lock-free reservation's form)
            rows = al.alloc_many_nowait(64 << 10, n, rows=True)
            assert rows.shape == (n, len(Allocation._fields)) and al.self_check() == []
            assert al.free_many(allocations_of_rows(rows)) == [True] * n
            as_list = al.alloc_many_nowait(64 << 10, n)
            key = lambda a: a.offset_bytes  # noqa: E731
            assert sorted(allocations_of_rows(rows), key=key) == sorted(as_list, key=key)
            assert al.free_many(as_list) == [True] * n
            assert al.self_check() == []
            rep = run_fsck(region_path, liveness_timeout_s=LIVENESS_S)
            assert rep.clean, rep.text()
            assert await al.close(lock, timeout=10) == 4      # every chunk empty again
            assert al.statistics().chunks == 0
        lock.close()
    finally:
        r.close()


async def test_bulk_take_matches_per_chunk_take(region_path: str, backend: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A large rows batch takes its slots through one ``_take_runs`` call for all its chunks:
    the same rows, in the same order, and the same heap words and used counts in the region
    as the per-chunk path gives from the same state -- read through a second node's view, so
    on the incoherent backend only what the kernel flushed counts (negative control: without
    the heap flush that view sees other words). A slot that the free list hands out while it
    is marked used is refused with nothing changed, free lists included (negative control of
    the kernel's check)."""
    from tract_async.region import alloc as A
    from tract_async.region import layout as L
    import os
    import numpy as np
    import tract_kernels as K

    def heaps(r, al) -> bytes:  # noqa: ANN001 - through another node's (empty) cache
        other = K.make_mem(r.buf, backend, seed=99, evict_prob=0.0)
        g = al.geo
        out = bytearray()
        for ci in al.owned_chunks():
            raw = np.zeros((1 + g.heap_bitmap_lines) * L.LINE_BYTES, dtype=np.uint8)
            K.read_bytes(other, g.heap_off(ci), raw.ctypes.data, raw.size, A.S_HEAP_READ)
            out += raw.tobytes()
        return bytes(out)

    modes = ("bulk", "each") + (("bulk-without-flush",) if backend == "sim" else ())
    results = {}
    for mode in modes:
        path = f"{region_path}-{mode}"
        monkeypatch.setattr(A, "TAKE_MIN_SLOTS", 1 << 30 if mode == "each" else 16)
        r = P.make_region(path, backend, size_bytes=8 << 20, chunk_bytes=1 << 20, evict_prob=0.0)
        try:
            h = r.nodes.join(0, timeout_s=LIVENESS_S)
            al = Allocator(r, h, liveness_timeout_s=LIVENESS_S, keep_free_chunks=0)
            lock = GlobalLock(r, h)
            async with node_services(r, h):
                await lock.acquire(timeout=10)
                try:     # 4 chunks of 16 slots, carved with 3 slots in use
                    first = al.alloc_many_locked(64 << 10, 3, lock)
                    al.preclaim_locked(64 << 10, 60, lock, max_chunks=3)
                finally:
                    lock.release()
                al.free_many(first[1:2])               # a hole: the free list is not in order
                mem = r.mem
                if mode == "bulk-without-flush":
                    r.mem = K.with_skip_site(mem, A.S_HEAP_FLUSH)
                rows = al.alloc_many_nowait(64 << 10, 40, rows=True)
                r.mem = mem
                results[mode] = (rows.copy(), heaps(r, al))
                if mode != "bulk-without-flush":
                    assert al.self_check() == []
                    al.free_rows(rows)
                    al.free_many([first[0], first[2]])
                    assert await al.close(lock, timeout=10) == 4
            lock.close()
        finally:
            r.close()
            if mode != "bulk-without-flush":
                rep = run_fsck(path, liveness_timeout_s=LIVENESS_S)
                assert rep.clean, rep.text()
            os.unlink(path)
    (rows_b, heap_b), (rows_e, heap_e) = results["bulk"], results["each"]
    assert rows_b.shape == (40, len(Allocation._fields))
    assert rows_b.tolist() == rows_e.tolist()
    assert heap_b == heap_e
    assert len({int(x) for x in rows_b[:, 0]}) == 40 and len(set(rows_b[:, 4].tolist())) >= 3
    if backend == "sim":
        rows_n, heap_n = results["bulk-without-flush"]
        assert rows_n.tolist() == rows_b.tolist() and heap_n != heap_b

    # negative control: a used slot on a free list is refused before anything changes
    monkeypatch.setattr(A, "TAKE_MIN_SLOTS", 16)
    r = P.make_region(region_path, backend, size_bytes=8 << 20, chunk_bytes=1 << 20)
    try:
        h = r.nodes.join(0, timeout_s=LIVENESS_S)
        al = Allocator(r, h, liveness_timeout_s=LIVENESS_S, keep_free_chunks=0)
        lock = GlobalLock(r, h)
        async with node_services(r, h):
            await lock.acquire(timeout=10)
            try:
                al.preclaim_locked(64 << 10, 32, lock, max_chunks=2)
            finally:
                lock.release()
            taken = al.alloc_many_nowait(64 << 10, 1)[0]
            c = al._chunks[taken.chunk_index]
            before = (c.used.copy(), c.words.copy(), heaps(r, al))
            c.free.append(taken.slot_index)            # the bug the check exists for
            with pytest.raises(AssertionError, match="which is marked used"):
                al.alloc_many_nowait(64 << 10, 20, rows=True)
            assert (c.used == before[0]).all() and (c.words == before[1]).all()
            assert heaps(r, al) == before[2]
            assert c.free[-1] == taken.slot_index     # the free lists as they were, too
            c.free.pop()                              # undo the damage, then clean up
            al.free(taken)
            assert al.self_check() == []
            assert await al.close(lock, timeout=10) == 2
        lock.close()
    finally:
        r.close()


@pytest.mark.parametrize("backend", ["hw", "sim"])
def test_asks_other_than_sees_another_nodes_ask_fresh_and_ignores_stale_or_own(
        region_path: str, backend: str) -> None:
    """``ChunkTable.asks_other_than`` (the reservation's look at chunk asks, one GIL-holding
    kernel) answers what ``wanted()`` does: an ask stored by another attachment is seen even
    after the reader cached the line (sim: the invalidation is what shows it), the asker's own
    ask does not count, an expired ask does not count."""
    import time as _time
    from tract_async.region import Region
    from tract_async.region import chunks as CH
    P.make_region(region_path, backend, evict_prob=0.0).close()
    ra = Region.attach(region_path, backend=backend, sim_seed=3, sim_evict_prob=0.0)
    rb = Region.attach(region_path, backend=backend, sim_seed=5, sim_evict_prob=0.0)
    try:
        ta, tb = CH.ChunkTable(ra), CH.ChunkTable(rb)
        assert not ta.asks_other_than(0)                 # (and node 0's view caches the lines)
        tb.set_wanted(1, 2)                              # node 1 asks, from its own view
        assert ta.asks_other_than(0) and bool(ta.wanted()[1] == 2)
        assert not ta.asks_other_than(1)                 # its own ask
        g = tb.geo
        K.store(rb.mem, g.count_off(1) + 24,            # the ask expired
                np.uint64(_time.time_ns() - int(CH.WANT_TTL_S * 1e9) - 1))
        K.flush(rb.mem, g.count_off(1) + 24, CH.S_COUNT_FLUSH)
        K.full_fence(rb.mem)
        assert not ta.asks_other_than(0) and int(ta.wanted()[1]) == 0
        tb.set_wanted(1, 0)
        assert not ta.asks_other_than(0)
    finally:
        ra.close()
        rb.close()
