"""A later layer's read of the blocks read last takes their slots (``prepare_read``'s known-slot
path: the layer bits re-read at those slots, no lookup), and a block evicted meanwhile -- its
slot even reused by another block with every layer in -- is a miss, never the other block's
bytes: the read's revalidation rejects it. Negative control: with revalidation switched off
the same read returns the other block's bytes, so the revalidation is what protects it."""
from __future__ import annotations

import numpy as np
import pytest

import tract_async as tract
from tests.support.engine_util import TINY, cfg, kv_for_keys
from tract_async.errors import BlockEvicted

N = 12                        # more than SMALL_READ: the snapshot path, not the fused one


async def _setup(eng: tract.Engine) -> tuple[list[bytes], np.ndarray]:
    keys = eng.block_keys(range(TINY.block_tokens * N), extra_keys=["a"])
    kv = kv_for_keys(keys, as_numpy=True)
    for layer in range(TINY.num_layers):
        await eng.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
    return keys, kv


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_later_layers_take_the_known_slots(region_path: str, backend: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as eng:
        keys, kv = await _setup(eng)
        st = eng._store.blocks.stats
        for layer in range(TINY.num_layers):
            got = await eng.get_kv(keys, layer=layer)
            assert np.array_equal(np.asarray(got), kv[layer]), layer
        assert st.known_slot_reads == TINY.num_layers - 1


async def _evict_and_put_again(eng: tract.Engine, keys: list[bytes],
                               kv: np.ndarray) -> np.ndarray:
    """Evict the blocks, let other blocks take their payload slots, and store the same keys
    again with other bytes: a new version of each entry (its index slot reused) with its
    payload elsewhere -- where the earlier read's offsets now hold the other blocks' bytes."""
    b = eng._store.blocks
    assert await b.evict(keys, timeout=10) == len(keys)
    filler = eng.block_keys(range(TINY.block_tokens * N), extra_keys=["filler"])
    await eng.put_kv(filler, kv_for_keys(filler, as_numpy=True))
    kv2 = kv + np.float32(1.0)
    for layer in range(TINY.num_layers):
        await eng.put_kv(keys, np.ascontiguousarray(kv2[layer]), layer=layer)
    return kv2


async def test_a_block_evicted_between_layers_is_a_miss_never_stale_bytes(
        region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        keys, kv = await _setup(eng)
        b = eng._store.blocks
        got = await eng.get_kv(keys, layer=0)          # the known slots: this read's
        assert np.array_equal(np.asarray(got), kv[0])
        old = b.reader.known[0][1].copy()
        kv2 = await _evict_and_put_again(eng, keys, kv)
        now = b.snapshot(b.read_words(keys))
        assert (now[:, 0] == old[:, 0]).all(), "the index slots were not reused"
        assert (now[:, 1] != old[:, 1]).all(), "no new versions"
        before = b.stats.known_slot_reads
        with pytest.raises(BlockEvicted):
            await eng.get_kv(keys, layer=1)
        assert b.stats.known_slot_reads == before + 1, "the known-slot path was not taken"
        # a new read of the keys finds the new blocks (and takes their slots from then on)
        assert np.array_equal(np.asarray(await eng.get_kv(keys, layer=1)), kv2[1])
        assert np.array_equal(np.asarray(await eng.get_kv(keys, layer=2)), kv2[2])


async def test_negative_control_without_revalidation_the_old_payload_is_read(
        region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        keys, kv = await _setup(eng)
        b = eng._store.blocks
        await eng.get_kv(keys, layer=0)
        old = b.reader.known[0][1].copy()
        kv2 = await _evict_and_put_again(eng, keys, kv)
        now = b.snapshot(b.read_words(keys))
        assert (now[:, 3] != old[:, 3]).all(), "some payloads stayed in place"
        b.validate_reads = False                       # the protection removed
        before = b.stats.known_slot_reads
        got = np.asarray(await eng.get_kv(keys, layer=1))
        assert b.stats.known_slot_reads == before + 1
        assert not np.array_equal(got, kv2[1]), "the known-slot read found the new bytes"
        assert not np.array_equal(got, kv[1]), "the old bytes are still there"


async def test_interleaved_requests_each_keep_their_known_slots(region_path: str) -> None:
    """Two requests' layer reads alternate (a decode worker serving both): each later layer of
    either takes its own known slots, although every call checks a new key list."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        a_keys, a_kv = await _setup(eng)
        b_keys = eng.block_keys(range(TINY.block_tokens * N), extra_keys=["other"])
        b_kv = kv_for_keys(b_keys, as_numpy=True)
        for layer in range(TINY.num_layers):
            await eng.put_kv(b_keys, np.ascontiguousarray(b_kv[layer]), layer=layer)
        st = eng._store.blocks.stats
        for layer in range(TINY.num_layers):
            for keys, kv in ((list(a_keys), a_kv), (list(b_keys), b_kv)):
                got = await eng.get_kv(keys, layer=layer)
                assert np.array_equal(np.asarray(got), kv[layer])
        assert st.known_slot_reads == 2 * (TINY.num_layers - 1)


@pytest.mark.parametrize("n", [1, N])
async def test_a_read_prepared_by_kept_rows_waits_for_its_layer_and_misses_a_changed_block(
        region_path: str, n: int) -> None:
    """``ReadTxn.prepare_known`` (a CUDA layer stream's later layers, of any size: a one-block
    stream keeps its first layer's rows too): not ready before the layer is in; the kept
    slots once it is; and after the blocks were evicted and stored again in those slots, the
    revalidation rejects the read (a miss), however fine the refreshed rows look."""
    from tract_async.stores.txn import ReadTxn
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        b = eng._store.blocks
        keys = eng.block_keys(range(TINY.block_tokens * n), extra_keys=["kept"])
        kv = kv_for_keys(keys, as_numpy=True)
        await eng.put_kv(keys, np.ascontiguousarray(kv[0]), layer=0)
        t0 = ReadTxn(b, keys, 0, None, "cuda")
        rows = (await t0.prepare()).copy()
        t1 = ReadTxn(b, keys, 1, None, "cuda", words=t0.words)
        before = b.stats.known_slot_reads
        assert not t1.prepare_known(rows)               # layer 1 is not in yet
        for layer in range(1, TINY.num_layers):
            await eng.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
        t1 = ReadTxn(b, keys, 1, None, "cuda", words=t0.words)
        assert t1.prepare_known(rows)
        assert b.stats.known_slot_reads == before + 1
        assert (t1.snap[:, 3] == rows[:, 3]).all()      # the kept payloads
        t1.validate(n * TINY.layer_bytes, cpu=False)
        await _evict_and_put_again(eng, keys, kv)
        now = b.snapshot(b.read_words(keys))
        if (now[:, 0] == rows[:, 0]).all():             # the slots reused: rows look fine
            t2 = ReadTxn(b, keys, 2, None, "cuda", words=t0.words)
            assert t2.prepare_known(rows)
            with pytest.raises(BlockEvicted):
                t2.validate(n * TINY.layer_bytes, cpu=False)
        else:
            assert not ReadTxn(b, keys, 2, None, "cuda", words=t0.words).prepare_known(rows)
