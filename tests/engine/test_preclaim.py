"""Pre-claimed chunks (``stores/preclaim.py``): after a put that had to
claim chunks, a node claims ahead while idle, so that its next put of that size reserves
without the global lock; within its share of the free chunks, not while another node asks,
and off with ``preclaim_bytes=0``."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

import tract_async as tract
from tests.support import procs_engine as P
from tract_async import errors as E
from tests.support.engine_util import TINY, cfg, kv_for_keys, until

BLOCKS = 40          # 1.25 MiB of 32 KiB blocks: two 1 MiB chunks, 24 slots left free


def _keys(eng: tract.Engine, start: int) -> list[bytes]:
    return eng.block_keys(range(start * TINY.block_tokens, (start + BLOCKS) * TINY.block_tokens))


async def test_next_put_reserves_without_the_lock(region_path: str, backend: str) -> None:
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, backend=backend,
                                      region_bytes=64 << 20))
    try:
        blocks = eng._store.blocks
        k1 = _keys(eng, 0)
        await eng.put_kv(k1, kv_for_keys(k1))
        assert await until(lambda: eng.stats()["preclaimed_chunks"] >= 1)
        assert blocks.alloc.free_slots(TINY.block_bytes) >= BLOCKS
        st = eng.stats()
        k2 = _keys(eng, BLOCKS)
        await eng.put_kv(k2, kv_for_keys(k2))
        after = eng.stats()
        assert after["lock_acquisitions"] == st["lock_acquisitions"]
        assert after["lockfree_reservations"] == st["lockfree_reservations"] + 1
        assert torch.equal(await eng.get_kv(k1 + k2), kv_for_keys(k1 + k2))
    finally:
        await eng.close()


async def test_off_and_capped(region_path: str) -> None:
    """``preclaim_bytes=0``, or a cap below what the free lists already hold: nothing is
    claimed ahead, and the next put, which the free lists cannot serve, takes the lock."""
    for pb in (0, 10 * TINY.block_bytes):
        eng = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=64 << 20,
                                          preclaim_bytes=pb))
        try:
            k1 = _keys(eng, 0)
            await eng.put_kv(k1, kv_for_keys(k1))
            await asyncio.sleep(0.2)
            assert eng.stats()["preclaimed_chunks"] == 0, pb
            st = eng.stats()
            k2 = _keys(eng, 3 * BLOCKS)
            await eng.put_kv(k2, kv_for_keys(k2))            # 40 blocks, 24 slots free
            assert eng.stats()["lock_acquisitions"] > st["lock_acquisitions"], pb
        finally:
            await eng.close()
            os.unlink(region_path)


async def test_not_while_another_node_asks_and_within_its_share(region_path: str) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=24 << 20))
    b = await tract.Engine.open(cfg(region_path, 1))
    try:
        ba = a._store.blocks
        table = ba.alloc.table
        nchunks = ba.ageo.nchunks
        await b._store.blocks.lock.acquire(timeout=5)
        try:
            table.set_wanted(1, 2)                       # node 1 asks for two chunks
        finally:
            b._store.blocks.lock.release()
        k1 = _keys(a, 0)
        await a.put_kv(k1, kv_for_keys(k1))
        await asyncio.sleep(0.2)
        assert a.stats()["preclaimed_chunks"] == 0
        assert await ba.preclaimer.claim(timeout=5) == 0
        await b._store.blocks.lock.acquire(timeout=5)
        try:
            table.set_wanted(1, 0)
        finally:
            b._store.blocks.lock.release()
        # a put after which the claim ahead would want more chunks than this node's share of
        # the free ones (free chunks / live nodes): it stops there, the rest stays free
        big = a.block_keys(range(1000 * TINY.block_tokens, 1300 * TINY.block_tokens))
        await a.put_kv(big, kv_for_keys(big))
        free_before = int((~table.bitmap()).sum())
        assert free_before >= 4, (free_before, nchunks)
        assert await until(lambda: a.stats()["preclaimed_chunks"] >= 1)
        await asyncio.sleep(0.1)
        assert a.stats()["preclaimed_chunks"] == free_before // 2
        assert int((~table.bitmap()).sum()) == free_before - free_before // 2
    finally:
        await b.close()
        await a.close()


async def test_dead_nodes_chunks_come_back_without_a_claim(region_path: str) -> None:
    """With pre-claimed chunks, the survivors' puts need no claim, so the claim path no longer
    reclaims a dead node's chunks: the lock manager's maintenance does
    (``Allocator.dead_hold_chunks``), within a few liveness timeouts of the death, while the
    survivor keeps putting lock-free."""
    a = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=64 << 20))
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(
        target=P.put_then_hang,
        args=(region_path, "hw", 1, list(range(5000 * TINY.block_tokens,
                                              5040 * TINY.block_tokens)),
              False, q, dict(region_bytes=64 << 20)))
    p.start()
    try:
        assert (await asyncio.get_running_loop().run_in_executor(None, q.get, True, 120))[0] \
            == "stored"
        table = a._store.blocks.alloc.table
        assert int(table.counts()["chunks"][1]) >= 2       # its blocks' (and any ahead)
        k1 = _keys(a, 0)
        await a.put_kv(k1, kv_for_keys(k1))
        assert await until(lambda: a.stats()["preclaimed_chunks"] >= 1)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        t0 = time.monotonic()
        claims = a._store.alloc.statistics()
        assert await until(lambda: int(table.counts()["chunks"][1]) == 0, timeout=6.0)
        took = time.monotonic() - t0
        assert took < 4 * a.cfg.liveness_timeout_s, took
        k2 = _keys(a, BLOCKS)
        await a.put_kv(k2, kv_for_keys(k2))          # served by the pre-claimed slots
        assert a._store.alloc.statistics().chunk_claims == claims.chunk_claims
        assert torch.equal(await a.get_kv(k1 + k2), kv_for_keys(k1 + k2))
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
        await a.close()


async def test_back_to_back_puts_are_left_alone(region_path: str) -> None:
    """A stream of puts with no idle moment between them: the pre-claim task never takes the
    lock from it (each put claims what it needs itself, as without pre-claiming); once the
    stream pauses, it claims ahead."""
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=64 << 20))
    try:
        for i in range(6):
            k = _keys(eng, i * BLOCKS)
            await eng.put_kv(k, kv_for_keys(k))
        assert eng.stats()["preclaimed_chunks"] == 0
        assert await until(lambda: eng.stats()["preclaimed_chunks"] >= 1)
    finally:
        await eng.close()


async def test_a_full_cache_evicts_ahead_and_the_next_put_is_lockfree(region_path: str,
                                                                      backend: str) -> None:
    """In a full region the pre-claim task evicts this node's least recently used blocks in
    an idle moment ("Evicting ahead"), so the next put of the same size reserves without the
    lock; the newest blocks stay readable, the oldest are gone."""
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, backend=backend,
                                      region_bytes=16 << 20))
    try:
        nchunks = eng._store.blocks.ageo.nchunks
        i = 0
        while eng.stats()["evictions"] == 0:             # fill it: until a put had to evict
            k = _keys(eng, i * BLOCKS)
            await eng.put_kv(k, kv_for_keys(k))
            i += 1
            assert i < 4 * nchunks, "the region never filled"
        assert await until(lambda: eng.stats()["evicted_ahead"] >= 1)
        await asyncio.sleep(0.05)                         # any further batch of it
        st = eng.stats()
        k = _keys(eng, i * BLOCKS)
        await eng.put_kv(k, kv_for_keys(k))
        after = eng.stats()
        assert after["lock_acquisitions"] == st["lock_acquisitions"]
        assert after["lockfree_reservations"] == st["lockfree_reservations"] + 1
        assert after["evictions"] == st["evictions"]     # the room was made before the put
        assert torch.equal(await eng.get_kv(k), kv_for_keys(k))
        assert eng.lookup(_keys(eng, 0)) == 0               # the oldest went first
    finally:
        await eng.close()


async def test_evicting_ahead_takes_only_this_nodes_blocks(region_path: str) -> None:
    """The eviction ahead of need frees this node's own slots only (``only_own``): with no
    READY block of its own, node 1 evicts nothing, and node 0's blocks all stay. Negative
    control: the put path's eviction (own blocks first, then others') does take node 0's."""
    a = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=16 << 20))
    b = await tract.Engine.open(cfg(region_path, 1))
    try:
        k = _keys(a, 0)
        await a.put_kv(k, kv_for_keys(k))
        bb = b._store.blocks
        await bb.lock.acquire(timeout=5)
        try:
            assert bb.evict_lru_locked(8, only_own=True) == 0
        finally:
            bb.lock.release()
        assert a.lookup(k) == BLOCKS
        await bb.lock.acquire(timeout=5)
        try:
            assert bb.evict_lru_locked(8) == 8
        finally:
            bb.lock.release()
        assert a.lookup(k) < BLOCKS
    finally:
        await b.close()
        await a.close()


async def _full_cache_then_read_all(eng: tract.Engine, monkeypatch: "pytest.MonkeyPatch"
                                    ) -> tuple[list[bytes], dict[str, int], Any]:
    """Fill ``eng``'s region until its puts evict, let evicting ahead settle, put one more
    batch (the free lists fall below the headroom again: the pre-claim task is due), and start
    a get of every resident block whose copy takes 0.3 s. Returns the keys, the stats before
    the get, and the get's task."""
    from tract_async.region import index as ix
    i = 0
    while eng.stats()["evictions"] == 0:
        k = _keys(eng, i * BLOCKS)
        await eng.put_kv(k, kv_for_keys(k))
        i += 1
        assert i < 64, "the region never filled"
    assert await until(lambda: eng.stats()["evicted_ahead"] >= 1)
    await asyncio.sleep(0.05)
    resident = [key for j in range(i) for key in _keys(eng, j * BLOCKS)
                if eng.lookup([key]) == 1]
    for name in ("copy_out", "copy_out_nt"):
        real = getattr(ix, name)

        def slow(*a: Any, _real: Any = real) -> Any:
            time.sleep(0.3)
            return _real(*a)
        monkeypatch.setattr(ix, name, slow)
    k = _keys(eng, i * BLOCKS)
    await eng.put_kv(k, kv_for_keys(k))                  # the headroom is short again
    before = eng.stats()
    return resident, before, asyncio.ensure_future(eng.get_kv(resident))


async def test_no_evicting_ahead_while_a_read_is_in_flight(region_path: str,
                                                          monkeypatch: "pytest.MonkeyPatch"
                                                          ) -> None:
    """A read of this node is not an idle moment: evicting ahead would take the blocks it
    reads (their touches reach the region only after it) and turn it into a miss. Negative
    control: when the pre-claim task ignores reads, the same read loses blocks."""
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=16 << 20))
    try:
        resident, before, get = await _full_cache_then_read_all(eng, monkeypatch)
        got = await get
        assert eng.stats()["evicted_ahead"] == before["evicted_ahead"]   # none during it
        assert torch.equal(got, kv_for_keys(resident))
        # once the read is over, the idle moment comes and the pre-claim task evicts ahead
        assert await until(lambda: eng.stats()["evicted_ahead"] > before["evicted_ahead"])
    finally:
        await eng.close()


async def test_negative_control_evicting_ahead_during_a_read_loses_blocks(
        region_path: str, monkeypatch: "pytest.MonkeyPatch") -> None:
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=16 << 20))
    try:
        b = eng._store.blocks
        pc = b.preclaimer
        monkeypatch.setattr(pc, "busy", lambda: bool(b.in_flight or pc._reserving))
        _, before, get = await _full_cache_then_read_all(eng, monkeypatch)
        with pytest.raises(E.BlockEvicted):
            await get
        assert eng.stats()["evicted_ahead"] > before["evicted_ahead"]
    finally:
        await eng.close()
