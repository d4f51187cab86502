"""The one-block fast path of ``put_kv`` / ``get_kv`` (``stores/small.py``): the common case takes
it and moves the same bytes as the full path, timed as the full path when phases are on; every
other case goes the full path, with its errors; a closed engine, a wanted lock and an engine
with a network store never take it."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import tract_async as tract
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys, np_out
from tract_async.errors import BlockNotFound, EngineClosed, KeyMismatch, TensorMismatch


async def _ready(path: str) -> tract.Engine:
    """An engine whose node has taken its lane (before that every put takes the locked path)."""
    eng = await tract.Engine.open(cfg(path, 0, create=True))
    warm = eng.block_keys(range(16))
    await eng.put_kv(warm, kv_for_keys(warm))
    return eng


def _counts(eng: tract.Engine) -> tuple[int, int]:
    st = eng.stats()
    return st["small_puts"], st["small_gets"]


async def test_one_block_goes_the_fast_path_both_ways(region_path: str) -> None:
    eng = await _ready(region_path)
    try:
        st = eng._store.stats
        keys = eng.block_keys(range(100, 116))          # one block of BlockKey
        kv = kv_for_keys(keys)
        f0 = st.fused_puts
        assert await eng.put_kv(keys, kv) == 1
        assert _counts(eng) == (1, 0) and st.fused_puts == f0 + 1
        assert await eng.put_kv(keys, kv) == 0            # present: skipped, still this path
        assert _counts(eng) == (2, 0)
        out = torch.empty_like(kv)
        assert await eng.get_kv(keys, out=out) is out
        assert torch.equal(out, kv) and _counts(eng) == (2, 1)
        raw = [bytes(keys[0])]                            # a plain bytes key, and a tuple
        out2 = torch.zeros_like(kv)
        assert await eng.get_kv(tuple(raw), out=out2) is out2 and torch.equal(out2, kv)
        assert _counts(eng) == (2, 2)
        # the full path reads what the fast path wrote, and the other way round
        assert all(block_matches(keys, await eng.get_kv(keys, out=np_out(keys))))
        other = eng.block_keys(range(200, 216))
        await eng.put_kv(other, kv_for_keys(other, as_numpy=True))     # numpy: the full path
        assert _counts(eng) == (2, 2)
        out3 = torch.empty_like(kv)
        await eng.get_kv(other, out=out3)
        assert all(block_matches(other, out3)) and _counts(eng) == (2, 3)
    finally:
        await eng.close()


async def test_every_other_case_takes_the_full_path(region_path: str) -> None:
    eng = await _ready(region_path)
    try:
        k1 = eng.block_keys(range(300, 316))
        k2 = eng.block_keys(range(300, 332))                # two blocks
        kv1, kv2 = kv_for_keys(k1), kv_for_keys(k2)
        assert await eng.put_kv(k2, kv2) == 2               # two keys
        assert await eng.put_kv([bytearray(k1[0])], kv1) == 0   # a bytearray key (present)
        lay = eng.block_keys(range(400, 416))
        for layer in range(TINY.num_layers):                # one layer at a time
            await eng.put_kv(lay, kv_for_keys(lay)[layer].contiguous(), layer=layer)
        nc = eng.block_keys(range(500, 516))
        base = torch.zeros(*TINY.kv_shape(1)[:-1], 2 * TINY.head_dim)
        base[..., ::2] = kv_for_keys(nc)
        wide = base[..., ::2]                               # the same values, not contiguous
        assert not wide.is_contiguous()
        assert await eng.put_kv(nc, wide) == 1
        assert _counts(eng) == (0, 0)
        assert all(block_matches(nc, await eng.get_kv(nc, out=np_out(nc))))
        out = torch.empty_like(kv1)
        assert torch.equal(await eng.get_kv(lay, out=out), kv_for_keys(lay))
        assert _counts(eng) == (0, 1)                       # that one was the common case
        await eng.get_kv(lay, layer=1, out=torch.empty_like(kv1[1]))
        await eng.get_kv(lay)                               # no out
        assert _counts(eng) == (0, 1)
        # the full path's errors, unchanged
        with pytest.raises(TensorMismatch):
            await eng.put_kv(k1, kv1.to(torch.float64))
        with pytest.raises(TensorMismatch):
            await eng.put_kv(k1, kv2)
        with pytest.raises(KeyMismatch):
            await eng.put_kv([b"short"], kv1)
        with pytest.raises(KeyMismatch):
            await eng.get_kv(["not bytes"], out=torch.empty_like(kv1))  # type: ignore[list-item]
        with pytest.raises(TensorMismatch):
            await eng.get_kv(lay, out=torch.empty_like(kv2))
        with pytest.raises(BlockNotFound):
            await eng.get_kv(eng.block_keys(range(900, 916)), out=torch.empty_like(kv1))
        assert _counts(eng) == (0, 1)
    finally:
        await eng.close()


async def test_a_waiting_get_falls_through_and_waits(region_path: str) -> None:
    """An absent block: the fast get declines, the full path waits for it and then reads."""
    eng = await _ready(region_path)
    try:
        keys = eng.block_keys(range(600, 616))
        kv = kv_for_keys(keys)
        out = torch.empty_like(kv)
        waiter = asyncio.create_task(eng.get_kv(keys, out=out, timeout=20.0))
        await asyncio.sleep(0.01)
        await eng.put_kv(keys, kv)
        assert await asyncio.wait_for(waiter, 20) is out and torch.equal(out, kv)
        assert _counts(eng) == (1, 0)
    finally:
        await eng.close()


async def test_phases_are_timed_as_on_the_full_path(region_path: str) -> None:
    """With ``time_phases`` on, the fast path records the ``fused`` phase and a put's
    ``publish`` stamp (the handoff benchmark subtracts it from the consumer's wake-up)."""
    eng = await _ready(region_path)
    try:
        keys = eng.block_keys(range(800, 816))
        kv = kv_for_keys(keys)
        ph = eng.time_phases(True)
        t0 = time.perf_counter_ns()
        await eng.put_kv(keys, kv)
        assert _counts(eng) == (1, 0)
        assert ph.stamps["publish"] >= t0 and ph.take()["fused"] > 0
        await eng.get_kv(keys, out=torch.empty_like(kv))
        assert _counts(eng) == (1, 1) and ph.take()["fused"] > 0
    finally:
        await eng.close()


async def test_a_wanted_lock_and_a_closed_engine_skip_it(region_path: str) -> None:
    eng = await _ready(region_path)
    keys = eng.block_keys(range(700, 716))
    kv = kv_for_keys(keys)
    try:
        await eng.put_kv(keys, kv)
        assert _counts(eng) == (1, 0)
        lock = eng._store.blocks.lock
        await lock._local._alock.acquire()    # a task of this process holds the node-local tier
        try:
            assert lock.wanted
            await eng.get_kv(keys, out=torch.empty_like(kv))
        finally:
            lock._local._alock.release()
        assert _counts(eng) == (1, 0)
        await eng.get_kv(keys, out=torch.empty_like(kv))
        assert _counts(eng) == (1, 1)
    finally:
        await eng.close()
    with pytest.raises(EngineClosed):
        await eng.put_kv(keys, kv)
    with pytest.raises(EngineClosed):
        await eng.get_kv(keys, out=torch.empty_like(kv))


async def test_a_network_engine_has_no_fast_path() -> None:
    async with tract.Engine.open(tract.EngineConfig(layout=TINY, region=None, listen_port=0,
                                                    allow_unauthenticated=True)) as eng:
        assert eng._small is None
        keys = eng.block_keys(range(16))
        await eng.put_kv(keys, kv_for_keys(keys))
        got = await eng.get_kv(keys, out=torch.empty(TINY.kv_shape(1)))
        assert all(block_matches(keys, got))


def test_the_words_match_keys_to_words() -> None:
    from tract_async.keys import keys_to_words
    from tract_async.stores.small import _WORDS
    k = bytes(range(32))
    assert np.array_equal(np.array([_WORDS.unpack(k)], dtype=np.uint64), keys_to_words([k]))
