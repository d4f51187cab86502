"""Every put and read path goes through one transaction (``stores/txn.py``; issue 37).

Each entry point of the region store -- the Engine's one-block fast path, the fused kernel of
a few blocks, the step-by-step CPU copy, a staged large put, the parallel read groups, and
(on a GPU) the CUDA DMA, and the network store's put and get over HTTP or NIXL -- must construct a ``PutTxn`` or ``ReadTxn`` and carry the operation
through it. The test drives each path, checks by the store's own counters that it really was
that path, and asserts that exactly one transaction of that path's label was opened (a staged
put: one for the put and one per stage). The deadline is one absolute value: a read that
waits on one path and goes on with another gets what is left of it, not the whole timeout
again.
"""
from __future__ import annotations

import hashlib
import time
from collections import Counter

import numpy as np
import pytest

import tract_async as tract
from tract_async import errors as E
from tract_async.stores import routing
from tract_async.stores.txn import Deadline, PutTxn, ReadTxn
from tests.support.engine_http_util import http_pair, needs_nixl
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys, np_out


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


class Opened:
    """The transactions opened per path since the last ``take``."""

    def __init__(self) -> None:
        self.put, self.read = Counter(PutTxn.opened), Counter(ReadTxn.opened)

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        put = dict(PutTxn.opened - self.put)
        read = dict(ReadTxn.opened - self.read)
        self.put, self.read = Counter(PutTxn.opened), Counter(ReadTxn.opened)
        return put, read


async def test_every_cpu_path_opens_one_transaction(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=3,
                                     region_bytes=64 << 20)) as eng:
        st = eng._store.stats
        warm = _keys("warm", 20)          # the first put takes the lane (locked, step by step)
        await eng.put_kv(warm, kv_for_keys(warm, as_numpy=True))
        seen = Opened()

        one = eng.block_keys(range(100, 116))            # one block: the Engine's fast path
        kv1 = kv_for_keys(one)
        assert await eng.put_kv(one, kv1) == 1
        assert st.small_puts == 1
        assert seen.take() == ({"small": 1}, {})
        out1 = kv1.clone()
        out1.zero_()
        assert await eng.get_kv(one, out=out1) is out1 and bool((out1 == kv1).all())
        assert st.small_gets == 1
        assert seen.take() == ({}, {"small": 1})

        few = _keys("few", 4)                             # a few blocks: the fused kernels
        fused_puts, fused_gets = st.fused_puts, st.fused_gets
        assert await eng.put_kv(few, kv_for_keys(few, as_numpy=True)) == 4
        assert st.fused_puts == fused_puts + 1
        assert seen.take() == ({"fused": 1}, {})
        assert all(block_matches(few, await eng.get_kv(few, out=np_out(few))))
        assert st.fused_gets == fused_gets + 1
        assert seen.take() == ({}, {"fused": 1})

        many = _keys("many", 40)                          # step by step, layer by layer
        kv = kv_for_keys(many, as_numpy=True)
        for layer in range(TINY.num_layers):
            assert await eng.put_kv(many, np.ascontiguousarray(kv[layer]), layer=layer) == 40
        assert seen.take() == ({"cpu": TINY.num_layers}, {})
        for layer in range(TINY.num_layers):
            got = await eng.get_kv(many, layer=layer, out=np_out(many, layer=layer))
            assert all(block_matches(many, got, layer=layer))
        assert seen.take() == ({}, {"cpu": TINY.num_layers})

        wide = _keys("wide", 96)                          # 3 MiB whole: the parallel groups
        await eng.put_kv(wide, kv_for_keys(wide, as_numpy=True))
        seen.take()
        reads = st.parallel_reads
        assert all(block_matches(wide, await eng.get_kv(wide, out=np_out(wide))))
        assert st.parallel_reads == reads + 1
        assert seen.take() == ({}, {"parallel": 1})


async def test_a_staged_put_opens_one_transaction_per_stage(
        region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stage = 160
    monkeypatch.setattr(routing, "STAGE_BLOCKS", stage)
    monkeypatch.setattr(routing, "STAGE_MIN_BLOCKS", 2 * stage)
    monkeypatch.setattr(routing, "STAGE_MIN_BYTES", 4 << 20)
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2,
                                     region_bytes=64 << 20)) as eng:
        seen = Opened()
        keys = _keys("staged", 3 * stage)
        assert await eng.put_kv(keys, kv_for_keys(keys, as_numpy=True)) == 3 * stage
        assert seen.take() == ({"staged": 1, "stage": 3}, {})
        assert all(block_matches(keys, await eng.get_kv(keys, out=np_out(keys))))
        assert eng._store.stats.puts == 1            # one put, however many stages


async def test_a_put_of_present_blocks_counts_once_on_every_path(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        st = eng._store.stats
        keys = _keys("present", 40)
        kv = kv_for_keys(keys, as_numpy=True)
        assert await eng.put_kv(keys, kv) == 40
        puts = st.puts
        assert await eng.put_kv(keys, kv) == 0         # every key present: nothing written
        assert st.puts == puts + 1 and st.blocks_skipped >= 40


def test_a_deadline_is_absolute() -> None:
    assert Deadline(None).left() is None
    assert Deadline(0).left() == 0                     # no waiting stays no waiting
    d = Deadline(0.2)
    first = d.left()
    assert first is not None and 0.15 < first <= 0.2
    time.sleep(0.05)
    second = d.left()
    assert second is not None and second <= first - 0.04
    d.at = time.monotonic() - 1.0                      # past: still one look, then a timeout
    assert d.left() == pytest.approx(1e-3)


async def test_a_read_of_absent_blocks_waits_its_timeout_once(region_path: str) -> None:
    """The fused read of absent blocks waits for them up to its deadline, once: the read fails
    after about its timeout, not after a second wait on the step-by-step path."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        keys = _keys("absent", 2)
        seen = Opened()
        t0 = time.monotonic()
        with pytest.raises((E.TransferTimeout, E.BlockNotFound)):
            await eng.get_kv(keys, out=np_out(keys), timeout=0.3)
        took = time.monotonic() - t0
        assert 0.25 <= took < 0.55, took
        assert seen.take() == ({}, {"fused": 1})


@pytest.mark.gpu
async def test_the_cuda_path_opens_one_transaction_each_way(region_path: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        keys = _keys("cuda", 12)
        kv = kv_for_keys(keys).cuda()
        seen = Opened()
        assert await eng.put_kv(keys, kv) == 12
        out = torch.empty_like(kv)
        assert await eng.get_kv(keys, out=out) is out
        torch.cuda.synchronize()
        assert torch.equal(out, kv)
        assert seen.take() == ({"cuda": 1}, {"cuda": 1})


@pytest.mark.parametrize("transport", ["http", pytest.param("nixl", marks=needs_nixl)])
async def test_the_network_paths_open_one_transaction_each_way(transport: str) -> None:
    """A put and a get of the HTTP store (and of NIXL's, its subclass) are transactions on the
    pool's lifecycle (``stores/poolsteps.py``): one per call, layer by layer too, local or
    remote, with the lifecycle's counters."""
    a, b = await http_pair(transport=transport)
    try:
        keys = b.block_keys(range(48))
        kv = kv_for_keys(keys)
        seen = Opened()
        for layer in range(TINY.num_layers):          # the first layer reserves, later ones resume
            assert await b.put_kv(keys, kv[layer].contiguous(), layer=layer) == 3
        assert seen.take() == ({"http": TINY.num_layers}, {})
        assert await b.put_kv(keys, kv) == 0          # held already: one transaction, no copy
        assert seen.take() == ({"http": 1}, {})
        assert a.lookup(keys) == 3
        assert all(block_matches(keys, await a.get_kv(keys)))     # remote: checked by the holder
        assert all(block_matches(keys, await b.get_kv(keys, layer=1), layer=1))   # local
        assert seen.take() == ({}, {"http": 2})
        sa, sb = a.stats(), b.stats()
        assert sa["remote_reads"] == 1 and sa["gets"] == 1 and sa["blocks_read"] == 3
        assert sb["puts"] == TINY.num_layers + 1 and sb["blocks_stored"] == 3
    finally:
        await b.close()
        await a.close()


async def test_a_network_put_whose_copy_fails_evicts_its_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``PutTxn.abandon`` on the pool: a layer put whose copy raises gives its slots back and
    tells the peers, who had heard of the block's earlier layer."""
    from tract_async.stores.http import HttpStore
    a, b = await http_pair()
    try:
        keys = b.block_keys(range(32))
        kv = kv_for_keys(keys)
        free = b._store.pool.free_slots
        assert await b.put_kv(keys, kv[0].contiguous(), layer=0) == 2
        assert b._store.pool.free_slots == free - 2 and a._store.has(keys[0])

        def boom(self: HttpStore, txn: PutTxn, kv: object) -> None:
            raise RuntimeError("copy failed")
        monkeypatch.setattr(HttpStore, "_copy_in", boom)
        seen = Opened()
        with pytest.raises(RuntimeError, match="copy failed"):
            await b.put_kv(keys, kv[1].contiguous(), layer=1)
        assert seen.take() == ({"http": 1}, {})
        assert b._store.pool.free_slots == free and not b._store.has(keys[0])
        assert not a._store.has(keys[0]) and not a._store.has(keys[1])   # the eviction was announced
        monkeypatch.undo()
        assert await b.put_kv(keys, kv) == 2          # the keys can be stored again
        assert a.lookup(keys) == 2
    finally:
        await b.close()
        await a.close()


async def test_a_network_read_has_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote read that waited for its blocks gets what is left of its deadline for the READ
    and for the holder's check, not the whole timeout again for each: here the wait takes
    ~0.3 s of 0.5 and the check 0.4 s, so the read times out (with a fresh timeout per step it
    returned after ~0.7 s), as a TransferTimeout that leaves the slow peer a peer."""
    import asyncio

    from tract_async.stores.http import HttpStore
    check = HttpStore._on_check

    async def slow_check(self: HttpStore, sender: str, payload: object) -> object:
        await asyncio.sleep(0.4)
        return await check(self, sender, payload)
    monkeypatch.setattr(HttpStore, "_on_check", slow_check)
    a, b = await http_pair()
    try:
        keys = b.block_keys(range(32))
        kv = kv_for_keys(keys)

        async def later() -> None:
            await asyncio.sleep(0.3)
            await b.put_kv(keys, kv)
        put = asyncio.create_task(later())
        t0 = time.monotonic()
        with pytest.raises(E.TransferTimeout):
            await a.get_kv(keys, timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        await put
        # a slow holder is not a gone one: still a peer (a check that timed out was once taken
        # for a lost connection, and the peer dropped), and read in full with time to spare
        assert b._store.agent.name in a._store.peers
        assert all(block_matches(keys, await a.get_kv(keys, timeout=5.0)))
    finally:
        await b.close()
        await a.close()
