"""Parallel reads (``stores/parallel.py``): each copy thread snapshots, copies and revalidates
its own group of blocks.

The bytes are exact, whole and layer by layer, with the groups really run on the gang's
workers; a group that finds a layer missing sends the read to the step-by-step path, which
waits for it or raises as before; the sim backend never takes the path. A deterministic torn
read: a worker's group is held after its snapshot while another node evicts one of its blocks
and writes another key into that slot; with the per-group revalidation the read gives up and
the step-by-step path reports the miss, without it (the negative control) the other key's bytes
come back as the block's.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tract_async as tract
from tract_async.stores import routing
from tract_async import errors as E
from tract_async.keys import keys_to_words
from tract_async.region import gangcopy as G
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys, np_out

N = 96          # blocks: 3 MiB of TINY's 32 KiB blocks (>= PARALLEL_COPY_BYTES whole)


def _keys(eng: tract.Engine, first: int, n: int = N) -> list[bytes]:
    bt = TINY.block_tokens
    return eng.block_keys(range(first * bt, (first + n) * bt))


async def test_parallel_reads_are_exact(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=3)) as a, \
            tract.Engine.open(cfg(region_path, 1, copy_threads=3)) as b:
        keys = _keys(a, 0)
        kv = kv_for_keys(keys, as_numpy=True)
        for layer in range(TINY.num_layers):
            await a.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
        st = b._store.stats
        got = await b.get_kv(keys, out=np_out(keys))
        assert all(block_matches(keys, got))
        assert st.parallel_reads == 1 and st.parallel_read_groups == 3
        for layer in range(TINY.num_layers):        # 768 KiB a layer: below 2 threads' worth
            got = await b.get_kv(keys, layer=layer, out=np_out(keys, layer=layer))
            assert all(block_matches(keys, got, layer=layer))
        assert st.parallel_reads == 1
        big = _keys(a, 1000, 4 * N)                 # 3 MiB a layer: the parallel path
        kvb = kv_for_keys(big, as_numpy=True)
        for layer in range(TINY.num_layers):
            await a.put_kv(big, np.ascontiguousarray(kvb[layer]), layer=layer)
            got = await b.get_kv(big, layer=layer, out=np_out(big, layer=layer), timeout=5)
            assert all(block_matches(big, got, layer=layer)), layer
        assert st.parallel_reads == 1 + TINY.num_layers and st.parallel_reads_redone == 0
        assert st.hits == N + TINY.num_layers * (N + 4 * N)


async def test_a_layer_not_landed_goes_to_the_step_by_step_read(region_path: str) -> None:
    """The last key has layer 1 and the others not: the parallel read gives up, and the
    step-by-step read raises LayerNotReady without a timeout, or waits for the layer with one."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2)) as a, \
            tract.Engine.open(cfg(region_path, 1, copy_threads=2)) as b:
        keys = _keys(a, 0, 4 * N)
        kv = kv_for_keys(keys, as_numpy=True)
        bt = TINY.block_tokens
        await a.put_kv(keys, np.ascontiguousarray(kv[0]), layer=0)
        await a.put_kv(keys[-1:], np.ascontiguousarray(kv[1][:, -bt:]), layer=1)
        st = b._store.stats
        with pytest.raises(E.LayerNotReady):
            await b.get_kv(keys, layer=1, out=np_out(keys, layer=1))
        assert st.parallel_reads_redone == 1 and st.parallel_reads == 0
        waiting = asyncio.create_task(b.get_kv(keys, layer=1, out=np_out(keys, layer=1),
                                               timeout=10))
        await asyncio.sleep(0.05)
        await a.put_kv(keys[:-1], np.ascontiguousarray(kv[1][:, :-bt]), layer=1)
        got = await waiting
        assert all(block_matches(keys, got, layer=1))
        assert st.parallel_reads_redone == 2


async def test_the_sim_backend_reads_step_by_step(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim",
                                     copy_threads=2)) as a:
        keys = _keys(a, 0)
        await a.put_kv(keys, kv_for_keys(keys, as_numpy=True))
        got = await a.get_kv(keys, out=np_out(keys))
        assert all(block_matches(keys, got)) and a._store.stats.parallel_read_groups == 0


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "negative-control"])
async def test_a_group_revalidates_what_it_copied(region_path: str, validate: bool) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True))
    b = await tract.Engine.open(cfg(region_path, 1, copy_threads=2))
    try:
        x = _keys(a, 0)
        await a.put_kv(x, kv_for_keys(x, as_numpy=True))
        last = int(a._store.index.snapshot(keys_to_words(x[-1:]))[0, 3])
        hold = np.array([1, 0], dtype=np.uint64)
        bp = b._store.parallel
        bp.hold_after_snapshot = hold
        b._store.blocks.validate_reads = validate
        reader = asyncio.create_task(b.get_kv(x, out=np_out(x)))
        for _ in range(2000):                  # the worker's group (the last keys) snapshotted
            if hold[1]:
                break
            await asyncio.sleep(0.005)
        assert hold[1] == 1, "the worker's group never reached its hold"
        assert not reader.done()
        st = a._store
        assert await st.blocks.evict(x[-1:], timeout=10) == 1
        y = a.block_keys(range(900_000, 900_000 + TINY.block_tokens))
        await a.put_kv(y, kv_for_keys(y, as_numpy=True))
        assert int(st.index.snapshot(keys_to_words(y))[0, 3]) == last, \
            "Y must have been written into the last block's slot"
        bp.hold_after_snapshot = None
        hold[0] = 0
        if validate:
            with pytest.raises(E.BlockNotFound):   # the step-by-step read finds it gone
                await reader
            assert b._store.stats.parallel_reads_redone == 1
        else:
            got = await reader
            ok = block_matches(x, got)
            assert all(ok[:-1]) and not ok[-1], "expected Y's bytes in the last block's place"
            assert all(block_matches(y, got[:, :, -TINY.block_tokens:]))
    finally:
        await b.close()
        await a.close()


async def test_reads_of_few_blocks_keep_the_step_by_step_path(region_path: str) -> None:
    """Fewer than ``PARALLEL_MIN_BLOCKS`` blocks, even of enough bytes for several threads."""
    lay = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=8, head_dim=128,
                         dtype=TINY.dtype)                         # 256 KiB blocks
    n = routing.PARALLEL_MIN_BLOCKS - 1
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=4, layout=lay,
                                     chunk_bytes=4 << 20, region_bytes=64 << 20)) as a:
        keys = a.block_keys(range(n * lay.block_tokens))
        kv = kv_for_keys(keys, lay)
        await a.put_kv(keys, kv)
        got = await a.get_kv(keys)
        assert all(block_matches(keys, got, lay))
        assert a._store.stats.parallel_read_groups == 0 and n * lay.block_bytes >= 4 << 20


async def test_a_cancelled_parallel_read_waits_for_its_workers(region_path: str) -> None:
    """A worker's group cannot be interrupted: a cancelled read returns (cancelled) only once
    every group is done -- its output is written by nobody afterwards (docs/design.md invariant 7)
    -- and the gang serves the next read."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2)) as a:
        x = _keys(a, 0)
        await a.put_kv(x, kv_for_keys(x, as_numpy=True))
        hold = np.array([1, 0], dtype=np.uint64)
        a._store.parallel.hold_after_snapshot = hold
        reader = asyncio.create_task(a.get_kv(x, out=np_out(x)))
        for _ in range(2000):
            if hold[1]:
                break
            await asyncio.sleep(0.005)
        assert hold[1] == 1
        reader.cancel()
        await asyncio.sleep(0.1)
        assert not reader.done(), "the cancelled read returned while its worker still copies"
        a._store.parallel.hold_after_snapshot = None
        hold[0] = 0
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert a._store.copier.idle_gang() is not None
        got = await a.get_kv(x, out=np_out(x))
        assert all(block_matches(x, got)) and a._store.stats.parallel_reads == 1


async def test_large_groups_all_go_to_the_workers(region_path: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups above ``LOOP_SHARE_MAX_BYTES`` are all read by the workers (the loop's thread
    would be held for their whole copy); the bytes are exact either way."""
    monkeypatch.setattr(routing, "LOOP_SHARE_MAX_BYTES", 1 << 20)      # 3 MiB in 3 groups: 1 MiB
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=3)) as a:
        x = _keys(a, 0)
        await a.put_kv(x, kv_for_keys(x, as_numpy=True))
        gang = a._store.copier._gang                 # the put's copy made it
        done0 = int(gang.board[:, G.J_DONE].sum())
        got = await a.get_kv(x, out=np_out(x))
        assert all(block_matches(x, got))
        assert a._store.stats.parallel_read_groups == 3    # 1 MiB a group: the loop reads one
        monkeypatch.setattr(routing, "LOOP_SHARE_MAX_BYTES", (1 << 20) - 1)
        got = await a.get_kv(x, out=np_out(x))
        assert all(block_matches(x, got))
        st = a._store.stats
        assert st.parallel_reads == 2 and st.parallel_read_groups == 3 + 3   # workers: 3 of 3
        # jobs done by the workers: 2 of the first read's groups, all 3 of the second's
        assert int(gang.board[:, G.J_DONE].sum()) - done0 == 2 + 3


async def test_transfer_mode_consumes_after_parallel_reads(region_path: str) -> None:
    """Transfer-only mode: blocks read by parallel reads are consumed as after any read --
    whole at once, or after the last layer read layer by layer."""
    kw = dict(copy_threads=2, mode="transfer")
    async with tract.Engine.open(cfg(region_path, 0, create=True, **kw)) as a, \
            tract.Engine.open(cfg(region_path, 1, **kw)) as b:
        x = _keys(a, 0)
        await a.put_kv(x, kv_for_keys(x, as_numpy=True))
        got = await b.get_kv(x, out=np_out(x))
        assert all(block_matches(x, got))
        assert b.lookup(x) == 0 and b.stats()["consumed"] == N
        y = _keys(a, 10_000, 4 * N)
        kvy = kv_for_keys(y, as_numpy=True)
        await a.put_kv(y, kvy)
        for layer in range(TINY.num_layers):
            assert b.lookup(y) == len(y)
            got = await b.get_kv(y, layer=layer, out=np_out(y, layer=layer))
            assert all(block_matches(y, got, layer=layer))
        assert b.lookup(y) == 0 and b.stats()["consumed"] == N + 4 * N
        assert b._store.stats.parallel_reads == 1 + TINY.num_layers


async def test_a_read_reuses_the_words_of_the_same_keys_only(region_path: str) -> None:
    """``BlockLifecycle.read_words`` caches the key words of the last large read's list: the
    same list again gives the same array; the list changed in place, or another list, gives
    fresh words, and the read returns the blocks of the keys it was given."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2)) as a:
        x, y = _keys(a, 0), _keys(a, 5000)
        await a.put_kv(x + y, kv_for_keys(x + y, as_numpy=True))
        blocks = a._store.blocks
        keys = list(x)
        w1 = blocks.read_words(keys)
        assert blocks.read_words(keys) is w1
        assert np.array_equal(w1, keys_to_words(x))
        keys[:] = y                                  # the same list object, other keys
        w2 = blocks.read_words(keys)
        assert w2 is not w1 and np.array_equal(w2, keys_to_words(y))
        got = await a.get_kv(keys, out=np_out(keys))
        assert all(block_matches(y, got))
        keys[:] = x
        got = await a.get_kv(keys, out=np_out(keys))
        assert all(block_matches(x, got))


async def test_a_wait_that_times_out_names_every_missing_block(region_path: str) -> None:
    """The parallel read waits for the last key only; when that wait times out, the
    step-by-step read looks at every key and says how many did not come (not "1 of 1")."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2)) as a:
        keys = _keys(a, 0, 4 * N)
        bt = TINY.block_tokens
        kv = kv_for_keys(keys, as_numpy=True)
        await a.put_kv(keys[:N], np.ascontiguousarray(kv[0][:, :N * bt]), layer=0)
        with pytest.raises(E.TransferTimeout, match=f"{3 * N} of {4 * N} blocks"):
            await a.get_kv(keys, layer=0, out=np_out(keys, layer=0), timeout=0.2)
        await a._store.blocks.abandon(keys[:N])
