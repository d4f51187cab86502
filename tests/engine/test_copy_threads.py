"""Large CPU copies on several threads (``stores/cpucopy.py``, "Copies on several threads").

A put or get of at least ``PARALLEL_COPY_BYTES`` on the hardware backend is cut into row
groups (``threads_for``: one per ``THREAD_MIN_BYTES``, at most ``copy_threads``), each copied on
its own thread of the copier's pool. These tests
check the bytes (whole blocks, one huge block whose two rows must be cut, single layers), that
the groups really run at once, that a cancelled put or get returns only after every thread is
done and leaves the region consistent (fsck clean), and that the sim backend stays on one
thread. The copy functions are wrapped where a test needs to see (or slow down) the threads:
the store looks them up in ``region/index.py`` at every call.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tract_async as tract
from tract_async.stores import routing
from tract_async import errors as E
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys
from tract_async.tools.fsck import run_fsck
from tract_async.region import index as ix
from tract_async.stores import cpucopy as rs

HUGE = tract.KVLayout(num_layers=1, block_tokens=4096, kv_heads=8, head_dim=128,
                      dtype=torch.float32)
"""One block of 32 MiB: two rows (K, V) of 16 MiB, fewer rows than threads."""

MID = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=8, head_dim=128,
                     dtype=torch.float32)
"""256 KiB blocks, 64 KiB rows: 128 blocks are 32 MiB, one layer of them 16 MiB."""


@dataclass
class Spy:
    """Wraps a copy function: records each call's thread and bytes, optionally sleeps first
    (outside the GIL) so that a test can act while the threads are mid-copy."""
    real: Callable[..., Any]
    delay_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: list[tuple[int, int]] = field(default_factory=list)     # (thread id, bytes)
    running: int = 0
    most_at_once: int = 0
    finished: int = 0

    def __call__(self, m: Any, plan: np.ndarray, *args: Any) -> Any:
        with self.lock:
            self.calls.append((threading.get_ident(), int(plan[:, 2].sum())))
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            return self.real(m, plan, *args)
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, delay_s: float = 0.0) -> Spy:
    spy = Spy(getattr(ix, name), delay_s)
    monkeypatch.setattr(ix, name, spy)
    return spy


def _assert_even_groups(spy: Spy, nbytes: int, parts: int) -> None:
    sizes = [b for _, b in spy.calls]
    assert len(sizes) == parts, sizes
    assert sum(sizes) == nbytes
    assert max(sizes) - min(sizes) <= 2 * rs.SPLIT_ALIGN, sizes


# -- the split itself ---------------------------------------------------------------------------

def _bytes_of(plan: np.ndarray) -> list[tuple[int, int]]:
    """Every (region byte, private byte) pair a plan copies, in order (small plans only)."""
    return [(int(r[0]) + i, int(r[1]) + i) for r in plan for i in range(int(r[2]))]


@pytest.mark.parametrize("rows,parts", [
    ([(4096, 0, 1 << 16)], 4),                                  # one row, cut three times
    ([(100, 7, 50_000)], 3),                                    # unaligned row
    ([(i * 8192, i * 8192, 8192) for i in range(10)], 4),       # many rows, cuts inside rows
    ([(i * 50_000, i * 3000, 3000) for i in range(7)], 8),      # fewer bytes than cut spacing
    ([(0, 0, 10)], 4),                                          # tiny: one group
    ([(0, 0, 0), (64, 0, 20_000), (0, 0, 0)], 2),               # empty rows
    ([(0, 0, 4096)], 2),                                        # the cut rounds to the end
    ([(0, 0, 4096), (8192, 4096, 4096)], 4),                    # cuts round to row ends
])
def test_split_plan_covers_every_byte_once_in_order(rows: list[tuple[int, int, int]],
                                                   parts: int) -> None:
    plan = np.array(rows, dtype=np.int64)
    groups = rs.split_plan(plan, parts)
    assert 1 <= len(groups) <= parts
    for g in groups:
        assert g.dtype == np.int64 and g.flags.c_contiguous and g.ndim == 2 and g.shape[1] == 3
        assert int(g[:, 2].sum()) > 0
    assert _bytes_of(np.concatenate(groups)) == _bytes_of(plan)
    for a, b in zip(groups, groups[1:]):       # a row cut between groups: at a 4 KiB address
        if a[-1, 0] + a[-1, 2] == b[0, 0] and a[-1, 1] + a[-1, 2] == b[0, 1]:
            assert b[0, 0] % rs.SPLIT_ALIGN == 0, (a[-1], b[0])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 2000)), min_size=1, max_size=8),
       st.integers(1, 9))
def test_split_plan_properties(gaps_sizes: list[tuple[int, int]], parts: int) -> None:
    """Any plan of disjoint rows (a gap before each): the groups copy exactly its bytes in its
    order, at most ``parts`` groups, none empty unless the plan copies nothing, and a row cut
    between two groups is cut at a multiple of ``align`` of its region address."""
    align = 64
    rows, roff, poff = [], 0, 0
    for gap, size in gaps_sizes:
        roff += gap
        rows.append((roff, poff, size))
        roff += size
        poff += size + gap // 2
    plan = np.array(rows, dtype=np.int64)
    groups = rs.split_plan(plan, parts, align)
    assert 1 <= len(groups) <= parts
    assert _bytes_of(np.concatenate(groups)) == _bytes_of(plan)
    if int(plan[:, 2].sum()):
        assert all(int(g[:, 2].sum()) > 0 for g in groups)
    for g, h in zip(groups, groups[1:]):
        if int(g[-1, 0] + g[-1, 2]) == int(h[0, 0]):    # rows are disjoint: one row, cut
            assert int(h[0, 0]) % align == 0, (g[-1], h[0])


def test_split_plan_of_one_huge_row_is_even() -> None:
    plan = np.array([[1 << 20, 0, 256 << 20]], dtype=np.int64)
    groups = rs.split_plan(plan, 8)
    assert [int(g[:, 2].sum()) for g in groups] == [32 << 20] * 8
    assert all(int(g[0, 0]) % rs.SPLIT_ALIGN == 0 for g in groups)


def test_copy_threads_default_comes_from_the_host(region_path: str) -> None:
    assert tract.EngineConfig(layout=TINY, region=region_path).copy_threads is None
    assert rs.auto_copy_threads(1) == 1
    assert rs.auto_copy_threads(2) == 1
    assert rs.auto_copy_threads(3) == 1
    assert rs.auto_copy_threads(4) == 2
    assert rs.auto_copy_threads(16) == 8
    assert rs.auto_copy_threads(128) == 8
    assert rs.auto_copy_threads() == max(1, min(8, len(os.sched_getaffinity(0)) // 2))
    for bad in (0, -1, True, 2.0):
        with pytest.raises(E.ConfigError):
            tract.EngineConfig(layout=TINY, region=region_path, copy_threads=bad)


def test_copy_threads_count_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process confined to 2 CPUs of a large host copies on one thread, as on a 2-core host;
    given 16 it takes 8, whatever ``os.cpu_count()`` says."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert rs.auto_copy_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert rs.auto_copy_threads() == 8


async def test_default_store_resolves_copy_threads_from_the_host(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        assert eng._store.copy_threads == rs.auto_copy_threads()


def test_threads_grow_with_the_copy_up_to_copy_threads() -> None:
    mib = 1 << 20
    assert routing.PARALLEL_COPY_BYTES == 2 * mib and routing.THREAD_MIN_BYTES == mib
    assert rs.threads_for(2 * mib - 1, 8) == 1        # below the threshold: one thread
    assert rs.threads_for(2 * mib, 8) == 2
    assert rs.threads_for(4 * mib, 8) == 4            # a 16 MiB handoff's layer
    assert rs.threads_for(5 * mib - 1, 8) == 4
    assert rs.threads_for(64 * mib, 8) == 8           # capped by copy_threads
    assert rs.threads_for(64 * mib, 1) == 1           # a 2-core host: never cut
    assert rs.threads_for(3 * mib, 2) == 2


# -- bytes through the engine -------------------------------------------------------------------

async def test_put_get_32_mib_on_four_threads_is_exact(region_path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    puts, gets = _spy(monkeypatch, "copy_in"), _spy(monkeypatch, "copy_out_nt")
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=4,
                                     region_bytes=96 << 20)) as eng:
        eng._store.parallel.enabled = False      # the step-by-step read's copies
        # (parallel reads: test_parallel_reads.py)
        n = (32 << 20) // TINY.block_bytes
        keys = eng.block_keys(range(TINY.block_tokens * n))
        kv = kv_for_keys(keys)
        assert await eng.put_kv(keys, kv) == n
        _assert_even_groups(puts, 32 << 20, 4)
        out = torch.full_like(kv, float("nan"))
        assert (await eng.get_kv(keys, out=out)) is out
        _assert_even_groups(gets, 32 << 20, 4)
        assert torch.equal(out, kv)
        assert all(block_matches(keys, await eng.get_kv(keys)))


async def test_one_huge_block_is_cut_across_threads(region_path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One 32 MiB block is two 16 MiB rows: with four threads each row is cut in two."""
    puts, gets = _spy(monkeypatch, "copy_in"), _spy(monkeypatch, "copy_out_nt")
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=4, layout=HUGE,
                                     region_bytes=160 << 20, chunk_bytes=32 << 20)) as eng:
        keys = eng.block_keys(range(HUGE.block_tokens))
        assert len(keys) == 1
        kv = kv_for_keys(keys, HUGE)
        assert await eng.put_kv(keys, kv) == 1
        _assert_even_groups(puts, HUGE.block_bytes, 4)
        out = torch.empty_like(kv)
        await eng.get_kv(keys, out=out)
        _assert_even_groups(gets, HUGE.block_bytes, 4)
        assert torch.equal(out, kv)


async def test_layer_puts_and_gets_on_four_threads_are_exact(
        region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer streaming: each layer of 128 blocks is 16 MiB, put and read one layer at a time
    (and whole afterwards), each copy on four threads."""
    puts, gets = _spy(monkeypatch, "copy_in"), _spy(monkeypatch, "copy_out_nt")
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=4, layout=MID,
                                     region_bytes=96 << 20, chunk_bytes=4 << 20)) as eng:
        eng._store.parallel.enabled = False      # the step-by-step read's copies
        # (parallel reads: test_parallel_reads.py)
        n = (32 << 20) // MID.block_bytes
        keys = eng.block_keys(range(MID.block_tokens * n))
        layer_bytes = n * MID.layer_bytes
        assert layer_bytes == 16 << 20
        for layer in range(MID.num_layers):
            await eng.put_kv(keys, kv_for_keys(keys, MID, layer), layer=layer)
        _assert_even_groups(puts, MID.num_layers * layer_bytes, 4 * MID.num_layers)
        for layer in range(MID.num_layers):
            got = await eng.get_kv(keys, layer=layer)
            assert torch.equal(got, kv_for_keys(keys, MID, layer)), layer
        assert len(gets.calls) == 4 * MID.num_layers
        out = torch.empty(MID.kv_shape(n), dtype=MID.dtype)
        await eng.get_kv(keys, out=out)
        assert all(block_matches(keys, out, MID))


async def test_a_4_mib_layer_is_cut_by_size_and_later_layers_skip_the_index(
        region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 MiB layer-streamed transfer: each 4 MiB layer is copied on four threads (one per
    MiB), also with eight allowed; only the first layer's put looks at the index (later layers
    fill blocks this node already reserved: ``BlockLifecycle.filling``)."""
    puts, gets = _spy(monkeypatch, "copy_in"), _spy(monkeypatch, "copy_out")
    layout = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=4, head_dim=64,
                            dtype=torch.bfloat16)            # 64 KiB blocks, 16 KiB a layer
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=8, layout=layout,
                                     region_bytes=96 << 20)) as eng:
        eng._store.parallel.enabled = False      # the step-by-step read's copies
        # (parallel reads: test_parallel_reads.py)
        blocks = eng._store.blocks
        snaps: list[int] = []
        real_snapshot = blocks.snapshot_for_put      # a put's look at the index (it may
        monkeypatch.setattr(blocks, "snapshot_for_put",  # skip the read: the kernel probes)
                            lambda w: snaps.append(len(w)) or real_snapshot(w))
        n = (16 << 20) // layout.block_bytes
        keys = eng.block_keys(range(layout.block_tokens * n))
        for layer in range(layout.num_layers):
            assert await eng.put_kv(keys, kv_for_keys(keys, layout, layer), layer=layer) == n
        assert snaps == [n]                  # the first layer only
        _assert_even_groups(puts, 16 << 20, 4 * layout.num_layers)
        assert eng.lookup(keys) == n
        for layer in range(layout.num_layers):
            got = await eng.get_kv(keys, layer=layer)
            assert torch.equal(got, kv_for_keys(keys, layout, layer)), layer
        _assert_even_groups(gets, 16 << 20, 4 * layout.num_layers)
        # a put of the same keys again (all READY now) takes the index path and skips them
        assert await eng.put_kv(keys, kv_for_keys(keys, layout, 0), layer=0) == 0
        assert snaps == [n, n]
    rep = run_fsck(region_path)
    assert rep.clean, rep.problems


@pytest.mark.parametrize("copy_threads", [1, 2, 4])
async def test_read_ahead_pair_is_exact(region_path: str, monkeypatch: pytest.MonkeyPatch,
                                        copy_threads: int) -> None:
    """``copy_read_ahead=True`` keeps the older two-thread read (drop ahead, copy behind) for
    large gets, whatever ``copy_threads`` says."""
    ahead, behind = _spy(monkeypatch, "drop_payload_rows_ahead"), _spy(monkeypatch,
                                                                       "copy_out_behind")
    groups = _spy(monkeypatch, "copy_out_nt")
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=copy_threads,
                                     copy_read_ahead=True, region_bytes=64 << 20)) as eng:
        n = (9 << 20) // TINY.block_bytes
        keys = eng.block_keys(range(TINY.block_tokens * n))
        kv = kv_for_keys(keys)
        await eng.put_kv(keys, kv)
        out = torch.empty_like(kv)
        await eng.get_kv(keys, out=out)
        assert torch.equal(out, kv)
    assert len(ahead.calls) == len(behind.calls) == 1 and not groups.calls
    # Not asserted: that the halves ran on two threads. The dropping half is submitted first
    # and never waits for the copying one, so a pool may run both on one worker when the first
    # ended before the second was picked up (seen under load); the copy is exact either way.


async def test_sim_backend_copies_on_one_thread(region_path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The sim's caches are per thread: its large copies stay whole, on one thread."""
    puts, gets = _spy(monkeypatch, "copy_in"), _spy(monkeypatch, "copy_out_nt")
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim", copy_threads=4,
                                     region_bytes=64 << 20)) as eng:
        n = (9 << 20) // TINY.block_bytes
        keys = eng.block_keys(range(TINY.block_tokens * n))
        kv = kv_for_keys(keys)
        await eng.put_kv(keys, kv)
        got = await eng.get_kv(keys)
        assert torch.equal(got, kv)
    assert [b for _, b in puts.calls] == [n * TINY.block_bytes]
    assert [b for _, b in gets.calls] == [n * TINY.block_bytes]


# -- cancellation -------------------------------------------------------------------------------

async def _cancel_mid_copy(spy: Spy, coro: Any) -> None:
    """Start ``coro``, cancel it while its copy threads are inside their (delayed) copies; it
    must raise CancelledError and nothing else, and only after every thread is done."""
    task = asyncio.ensure_future(coro)
    deadline = time.monotonic() + 30
    while spy.running < 4:
        assert not task.done(), task
        assert time.monotonic() < deadline, "the copy threads never started"
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert spy.running == 0 and spy.finished == len(spy.calls) == 4
    assert spy.most_at_once == 4


async def test_cancelled_get_and_put_wait_for_every_thread(region_path: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=4,
                                     region_bytes=128 << 20)) as eng:
        eng._store.parallel.enabled = False      # the step-by-step read's copies
        # (parallel reads: test_parallel_reads.py)
        n = (16 << 20) // TINY.block_bytes
        keys = eng.block_keys(range(TINY.block_tokens * n))
        more = eng.block_keys(range(10_000_000, 10_000_000 + TINY.block_tokens * n))
        kv, kv_more = kv_for_keys(keys), kv_for_keys(more)
        assert await eng.put_kv(keys, kv) == n

        slow_get = _spy(monkeypatch, "copy_out_nt", delay_s=0.3)
        out = torch.empty_like(kv)
        await _cancel_mid_copy(slow_get, eng.get_kv(keys, out=out))
        monkeypatch.setattr(ix, "copy_out_nt", slow_get.real)

        slow_put = _spy(monkeypatch, "copy_in", delay_s=0.3)
        await _cancel_mid_copy(slow_put, eng.put_kv(more, kv_more))
        monkeypatch.setattr(ix, "copy_in", slow_put.real)

        # the region is still consistent and usable: the cancelled put left nothing behind,
        # the earlier blocks read back exactly, the cancelled put's blocks can be put again
        assert eng.lookup(more) == 0
        got = torch.empty_like(kv)
        await eng.get_kv(keys, out=got)
        assert torch.equal(got, kv)
        assert await eng.put_kv(more, kv_more) == n
        got_more = torch.empty_like(kv_more)
        await eng.get_kv(more, out=got_more)
        assert torch.equal(got_more, kv_more)
    rep = run_fsck(region_path)
    assert rep.clean, rep.problems
