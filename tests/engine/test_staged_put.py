"""Staged large puts (``stores/region.py``, "Staged large puts").

A put of many new blocks is cut into stages; stage k+1 is reserved on the loop while the copy
threads copy stage k, and every stage is published only after the last copy. These tests use
small stages (patched) so that a few MiB make several: the bytes are exact whole and layer by
layer, under both backends (the sim's incoherent caches find a missing flush or invalidation);
a reservation really runs while an earlier stage's copy is in flight; and a failure in a later
stage -- the region full, a copy error, a cancellation mid-copy -- waits for the copy in flight
and leaves nothing stored, no slot leaked, fsck clean.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch

import tract_async as tract
from tract_async import errors as E
from tests.support.engine_util import TINY, block_matches, cfg, free_slots, kv_for_keys
from tract_async.tools.fsck import run_fsck
from tract_async.region import index as ix
from tract_async.stores import routing

STAGE = 160
"""Blocks per stage in these tests: 5 MiB of TINY's 32 KiB blocks, 1.25 MiB of one layer (a
stage copied inline, at most ``INLINE_COPY_BYTES``, is not staged)."""


@pytest.fixture(autouse=True)
def _small_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "STAGE_BLOCKS", STAGE)
    monkeypatch.setattr(routing, "STAGE_MIN_BLOCKS", 2 * STAGE)
    monkeypatch.setattr(routing, "STAGE_MIN_BYTES", 4 << 20)


@dataclass
class CopySpy:
    """Wraps ``index.copy_in``: counts the copies running now, optionally sleeps (outside the
    GIL) before each, and raises on the call numbered ``fail_at`` (0-based) instead of copying."""
    real: Callable[..., Any]
    delay_s: float = 0.0
    fail_at: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: list[int] = field(default_factory=list)          # bytes of each call
    running: int = 0
    finished: int = 0

    def __call__(self, m: Any, plan: np.ndarray, *args: Any) -> Any:
        with self.lock:
            k = len(self.calls)
            self.calls.append(int(plan[:, 2].sum()))
            self.running += 1
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if k == self.fail_at:
                raise OSError("copy failed (test)")
            return self.real(m, plan, *args)
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1


def _spy(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> CopySpy:
    spy = CopySpy(ix.copy_in, **kw)
    monkeypatch.setattr(ix, "copy_in", spy)
    return spy


@pytest.mark.parametrize("backend", ["hw", "sim"])
@pytest.mark.parametrize("layered", [False, True], ids=["blocks", "layers"])
async def test_staged_put_is_exact_and_reserves_during_copies(
        region_path: str, monkeypatch: pytest.MonkeyPatch, backend: str, layered: bool) -> None:
    spy = _spy(monkeypatch, delay_s=0.02)
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend,
                                     copy_threads=2, region_bytes=48 << 20)) as eng:
        blocks = eng._store.blocks
        # copies in flight when each reservation started, counted where the put hands them to
        # the copier (not when a thread runs the kernel: under load a thread may begin its
        # 20 ms copy only after the loop reserved the next stage -- [0, 0, 0, 0, 0] in 2 of 8
        # runs with two CPU hogs, the copy posted and in flight all along)
        during: list[int] = []
        copies = [0, 0]                 # copier.copy_in calls begun, ended
        copier = eng._store.copier
        real_copy_in, real_reserve = copier.copy_in, blocks.reserve

        async def copy_in(*a: Any, **k: Any) -> Any:
            copies[0] += 1
            try:
                return await real_copy_in(*a, **k)
            finally:
                copies[1] += 1

        async def reserve(*a: Any, **k: Any) -> Any:
            during.append(copies[0] - copies[1])
            return await real_reserve(*a, **k)
        monkeypatch.setattr(copier, "copy_in", copy_in)
        monkeypatch.setattr(blocks, "reserve", reserve)
        n = 5 * STAGE - 20                              # five stages, the last one short
        keys = eng.block_keys(range(TINY.block_tokens * n))
        puts0 = eng.stats()["puts"]
        if layered:
            for layer in range(TINY.num_layers):
                assert await eng.put_kv(keys, kv_for_keys(keys, TINY, layer), layer=layer) == n
            # the first layer is staged; later layers fill what it reserved (no reservation)
            assert len(during) == 5
            assert eng.stats()["puts"] - puts0 == TINY.num_layers
        else:
            assert await eng.put_kv(keys, kv_for_keys(keys)) == n
            assert len(during) == 5
            assert eng.stats()["puts"] - puts0 == 1          # one put, however many stages
        assert during[0] == 0
        assert any(during[1:]), during       # a later stage was reserved while a copy ran
        assert sum(spy.calls) == n * TINY.block_bytes        # every byte copied once
        assert eng.lookup(keys) == n
        out = torch.full_like(kv_for_keys(keys), float("nan"))
        await eng.get_kv(keys, out=out)
        assert all(block_matches(keys, out))
    rep = run_fsck(region_path)
    assert rep.clean, rep.problems


async def test_staged_put_that_fills_the_region_midway_stores_nothing(
        region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The region holds fewer blocks than the put: an early stage reserves and copies, a later
    one finds no room (its own earlier stages are RESERVED, not evictable) -> RegionFull, every
    stage abandoned, every slot back, and a put that fits still works."""
    spy = _spy(monkeypatch)
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2,
                                     region_bytes=16 << 20)) as eng:
        n = 12 * STAGE                                  # 60 MiB of blocks: more than fits
        keys = eng.block_keys(range(TINY.block_tokens * n))
        before = free_slots(eng)
        with pytest.raises(E.RegionFull):
            await eng.put_kv(keys, kv_for_keys(keys))
        assert spy.calls, "no stage was copied: the failure was not mid-way"
        assert spy.running == 0
        assert eng.lookup(keys) == 0
        assert eng._store.blocks.in_flight == 0
        assert free_slots(eng) >= before
        few = keys[:STAGE]
        assert await eng.put_kv(few, kv_for_keys(few)) == len(few)
        assert all(block_matches(few, await eng.get_kv(few)))
    rep = run_fsck(region_path)
    assert rep.clean, rep.problems


async def test_after_a_staged_put_that_filled_the_region_new_keys_are_stored_and_read_exact(
        region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sequence a GPU test of the (removed) staged CUDA puts failed (session 54: a later put
    of new keys read some blocks back as evicted, two reservations of one payload slot by the
    pattern), through the CPU's staged put: a put that fills the region mid-way fails, then puts
    of keys never seen before fill the room it gave back, and every one reads back exact --
    twice, so the second round reuses the first round's slots -- with as many slots in use as
    blocks stored."""
    spy = _spy(monkeypatch)
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2,
                                     region_bytes=16 << 20)) as eng:
        n = 12 * STAGE
        keys = eng.block_keys(range(TINY.block_tokens * n))
        with pytest.raises(E.RegionFull):
            await eng.put_kv(keys, kv_for_keys(keys))
        assert spy.calls, "no stage was copied: the failure was not mid-way"
        room = free_slots(eng)
        assert room >= STAGE
        for r in range(2):
            base = 10**6 * (r + 1)
            fresh = eng.block_keys(range(base, base + TINY.block_tokens * STAGE))
            assert await eng.put_kv(fresh, kv_for_keys(fresh)) == len(fresh)
            assert all(block_matches(fresh, await eng.get_kv(fresh)))
            assert free_slots(eng) == room - (r + 1) * len(fresh), r
            if r == 0:
                old = fresh
        assert all(block_matches(old, await eng.get_kv(old)))
    rep = run_fsck(region_path)
    assert rep.clean, rep.problems


async def test_staged_put_with_a_failing_copy_stores_nothing(
        region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second stage's copy raises: the put raises it once the copies are done, and none of
    its blocks is stored (the first stage's bytes are in memory, but never published)."""
    spy = _spy(monkeypatch, delay_s=0.01, fail_at=2)     # two groups per stage: stage 2's first
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2,
                                     region_bytes=48 << 20)) as eng:
        n = 4 * STAGE
        keys = eng.block_keys(range(TINY.block_tokens * n))
        with pytest.raises(OSError, match="copy failed"):
            await eng.put_kv(keys, kv_for_keys(keys))
        assert spy.running == 0 and spy.finished == len(spy.calls) >= 3
        assert eng.lookup(keys) == 0
        assert eng._store.blocks.in_flight == 0
        spy.fail_at = -1
        assert await eng.put_kv(keys, kv_for_keys(keys)) == n
        assert all(block_matches(keys, await eng.get_kv(keys)))
    rep = run_fsck(region_path)
    assert rep.clean, rep.problems


async def test_cancelled_staged_put_waits_for_its_copy_and_stores_nothing(
        region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _spy(monkeypatch, delay_s=0.3)
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2,
                                     region_bytes=48 << 20)) as eng:
        n = 4 * STAGE
        keys = eng.block_keys(range(TINY.block_tokens * n))
        task = asyncio.ensure_future(eng.put_kv(keys, kv_for_keys(keys)))
        deadline = time.monotonic() + 30
        while spy.running == 0:
            assert not task.done(), task
            assert time.monotonic() < deadline, "no stage copy started"
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert spy.running == 0 and spy.finished == len(spy.calls)   # no copy left running
        assert eng.lookup(keys) == 0
        assert eng._store.blocks.in_flight == 0
        spy.delay_s = 0.0
        assert await eng.put_kv(keys, kv_for_keys(keys)) == n
        assert all(block_matches(keys, await eng.get_kv(keys)))
    rep = run_fsck(region_path)
    assert rep.clean, rep.problems


async def test_one_copy_thread_is_not_staged(region_path: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With one copy thread (a 2-core host) the put stays one reservation and one copy."""
    spy = _spy(monkeypatch)
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=1,
                                     region_bytes=48 << 20)) as eng:
        n = 4 * STAGE
        keys = eng.block_keys(range(TINY.block_tokens * n))
        assert await eng.put_kv(keys, kv_for_keys(keys)) == n
        assert spy.calls == [n * TINY.block_bytes]
