"""The Engine API on the CPU path: put_kv, get_kv, lookup, layer streaming, modes, bad input.

Two Engines in one process are two nodes (each maps the region itself; with the sim backend
each has its own incoherent cache), so these tests exercise the cross-node protocol; the
cross-process versions are in test_engine_xproc.py.

The transport-independent tests run over both transports: the region ("region-hw",
"region-sim"), the HTTP agents ("http": two engines with Agents on 127.0.0.1, port 0, the
second naming the first as its peer) and NIXL ("nixl": the same, with NIXL agents for the bytes). Region internals (re-attach after close, RegionExists)
stay region-only; their HTTP counterparts are in test_engine_http.py.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from numba import njit

import tract_async as tract
from tract_async.stores import blocks as bfb
from tract_async import errors as E
from tests.support.engine_http_util import http_cfg, http_pair, needs_nixl
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys
from tract_async.tools.fsck import run_fsck
from tract_async.keys import keys_to_words
from tract_kernels.intrinsics import monotonic_ns


NET = ("http", "nixl")     # the network transports


@pytest.fixture(params=["region-hw", "region-sim", "http", pytest.param("nixl", marks=needs_nixl)])
def flavor(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(transport, memory backend): the backend only matters for the region."""
    transport, _, backend = request.param.partition("-")
    return transport, backend or "hw"


@pytest.fixture(params=["region", "http", pytest.param("nixl", marks=needs_nixl)])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


async def _pair(path: str, backend: str, transport: str = "region", **kw):
    if transport in NET:
        return await http_pair(transport=transport, **kw)
    a = await tract.Engine.open(cfg(path, 0, create=True, backend=backend, **kw))
    b = await tract.Engine.open(cfg(path, 1, backend=backend, **kw))
    return a, b


async def _one(path: str, transport: str, **kw) -> tract.Engine:
    if transport in NET:
        return await tract.Engine.open(http_cfg(0, transport=transport, **kw))
    return await tract.Engine.open(cfg(path, 0, create=True, **kw))


def _index_state(eng: tract.Engine) -> tuple[list, int]:
    if eng.stats()["transport"] in NET:   # the local pool: (slot, version, layers) per block
        pool = eng._store.pool
        return sorted((b.slot, b.version, b.mask) for _, b in pool.items()), pool.nslots - pool.free_slots
    table = eng._store.index.scan()
    return sorted(table[:, 0].tolist()), eng._store.alloc.statistics().slots_used


async def test_put_then_get_on_another_node(region_path: str, flavor: tuple[str, str]) -> None:
    a, b = await _pair(region_path, flavor[1], flavor[0])
    try:
        keys = a.block_keys(range(16 * 5 + 3))
        assert len(keys) == 5 and b.block_keys(range(83)) == keys   # same on every node
        assert b.lookup(keys) == 0
        kv = kv_for_keys(keys)
        assert await a.put_kv(keys, kv) == 5
        assert b.lookup(keys) == 5
        got = await b.get_kv(keys)
        assert torch.equal(got, kv)
        # a longer prompt sharing the prefix: partial hit
        longer = b.block_keys(list(range(16 * 5)) + list(range(500, 548)))
        assert longer[:5] == keys and b.lookup(longer) == 5
        # keys already present are not stored twice
        assert await b.put_kv(keys, kv) == 0
        assert b.stats()["blocks_skipped"] == 5
        out = torch.empty_like(kv)
        assert (await b.get_kv(keys[1:3], out=out[:, :, 16:48].contiguous())).shape == (4, 2, 32, 2, 32)
    finally:
        await b.close()
        await a.close()


async def test_layer_by_layer_and_waiting_consumer(region_path: str, flavor: tuple[str, str]) -> None:
    a, b = await _pair(region_path, flavor[1], flavor[0])
    try:
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        waiter = asyncio.create_task(b.get_kv(keys, layer=2, timeout=30.0))
        full = asyncio.create_task(b.get_kv(keys, timeout=30.0))
        await asyncio.sleep(0.05)
        assert not waiter.done() and not full.done()
        for layer in range(TINY.num_layers):
            await a.put_kv(keys, kv[layer].contiguous(), layer=layer)
            if layer < TINY.num_layers - 1:
                assert b.lookup(keys) == 0          # not complete: lookup does not count it
            got = await b.get_kv(keys, layer=layer)  # landed layers are readable at once
            assert torch.equal(got, kv[layer])
            if layer == 1:
                await asyncio.sleep(0.05)
                assert not waiter.done()            # layer 2 not yet there
        assert torch.equal(await asyncio.wait_for(waiter, 30), kv[2])
        assert torch.equal(await asyncio.wait_for(full, 30), kv)
        assert b.lookup(keys) == 4
        assert b.stats()["layer_waits"] >= 2
    finally:
        await b.close()
        await a.close()


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_layers_out_of_order_publish_exactly_what_landed(region_path: str,
                                                               backend: str) -> None:
    """Layers put in the order 2, 0, 3, 1 (and a layer put twice): after each, the other node
    reads exactly the layers that landed and no other, and the blocks are complete (READY)
    only after the last (``index.publish_layers`` ORs each layer's bit into what line 1
    holds: a publish that overwrote the earlier bits instead would lose them here)."""
    a, b = await _pair(region_path, backend)
    try:
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        landed: list[int] = []
        for layer in (2, 0, 0, 3, 1):
            await a.put_kv(keys, kv[layer].contiguous(), layer=layer)
            if layer not in landed:
                landed.append(layer)
            for other in range(TINY.num_layers):
                if other in landed:
                    assert torch.equal(await b.get_kv(keys, layer=other), kv[other]), other
                else:
                    with pytest.raises(E.LayerNotReady):
                        await b.get_kv(keys, layer=other)
            assert b.lookup(keys) == (len(keys) if len(landed) == TINY.num_layers else 0)
        assert torch.equal(await b.get_kv(keys), kv)
    finally:
        await b.close()
        await a.close()


async def test_layer_puts_of_other_shapes_than_the_first(region_path: str, backend: str) -> None:
    """A layer-streamed put shares one record of its blocks' layers across the batch
    (``blocks.FillBatch``). Later layers put for a subset, in another key order, or for the
    whole batch again must each publish exactly their blocks' layers: after each step the other
    node reads what landed, gets LayerNotReady for what did not, and the blocks turn READY (and
    leave the producer's bookkeeping) only with their last layer."""
    a, b = await _pair(region_path, backend)
    try:
        keys = a.block_keys(range(32 * TINY.block_tokens))
        assert len(keys) == 32
        kv = kv_for_keys(keys)
        rev = keys[::-1]
        kv_rev = kv_for_keys(rev)
        blocks = a._store.blocks

        async def landed(ks: list[bytes], layer: int, want: bool) -> None:
            if want:
                assert torch.equal(await b.get_kv(ks, layer=layer), kv_for_keys(ks, layer=layer))
            else:
                with pytest.raises(E.LayerNotReady):
                    await b.get_kv(ks, layer=layer)

        await a.put_kv(keys, kv[0].contiguous(), layer=0)       # reserves: one shared batch
        await a.put_kv(keys, kv[1].contiguous(), layer=1)       # the whole batch: fast path
        await landed(keys, 1, True)
        await landed(keys, 0, True)       # layer 1's publish kept layer 0's bits
        await landed(keys, 2, False)
        bt = TINY.block_tokens
        await a.put_kv(keys[:12], kv[2][:, :12 * bt].contiguous(), layer=2)   # a subset
        await landed(keys[:12], 2, True)
        await landed(keys[12:], 2, False)
        # layer 3 of the other 20 (lacking layer 2), in reverse key order: none is complete
        await a.put_kv(rev[:20], kv_rev[3][:, :20 * bt].contiguous(), layer=3)
        assert blocks.in_flight == len(keys) and b.lookup(keys) == 0 and b.lookup(rev) == 0
        await landed(rev[:20], 3, True)
        await landed(keys[:12], 3, False)
        await a.put_kv(keys[:12], kv[3][:, :12 * bt].contiguous(), layer=3)   # 12 complete
        assert blocks.in_flight == 20 and b.lookup(keys) == 12
        await a.put_kv(keys[12:], kv[2][:, 12 * bt:].contiguous(), layer=2)   # the rest
        assert blocks.in_flight == 0 and b.lookup(keys) == len(keys)
        assert torch.equal(await b.get_kv(keys), kv)
    finally:
        await b.close()
        await a.close()


async def test_a_batch_split_while_its_layer_is_in_flight(region_path: str, backend: str) -> None:
    """A layer put of a whole batch holds the ``FillBatch`` itself as its handle
    (``blocks.filling``). When another task abandons some of its keys before the layer is
    published, the batch is split (a Reservation per key) and the publish through the stale
    handle sets the layer of the remaining blocks only; the abandoned keys put again later are
    new reservations, and every block ends READY with the right bytes, or absent."""
    a, b = await _pair(region_path, backend)
    try:
        keys = a.block_keys(range(24 * TINY.block_tokens))
        kv = kv_for_keys(keys)
        blocks = a._store.blocks
        await a.put_kv(keys, kv[0].contiguous(), layer=0)
        handle = blocks.filling(keys)
        assert isinstance(handle, bfb.FillBatch) and handle.whole
        assert blocks.filling(list(keys)) is handle           # equal keys, another list
        await blocks.abandon(keys[:5])
        assert not handle.whole and blocks.in_flight == len(keys) - 5
        assert blocks.publish(keys, list(range(len(keys))), handle, 1, 0) == len(keys) - 5
        assert all(blocks.book.reserved[k].layers_lo == 0b11 for k in keys[5:])
        for layer in range(1, TINY.num_layers):    # the rest of the put, all keys again
            await a.put_kv(keys, kv[layer].contiguous(), layer=layer)
        assert blocks.in_flight == 5                  # the abandoned five lack layer 0
        assert b.lookup(keys[5:]) == len(keys) - 5 and b.lookup(keys) == 0
        assert torch.equal(await b.get_kv(keys[5:]), kv[:, :, 5 * TINY.block_tokens:])
        await a.put_kv(keys[:5], kv[0][:, :5 * TINY.block_tokens].contiguous(), layer=0)
        assert blocks.in_flight == 0 and b.lookup(keys) == len(keys)
        assert torch.equal(await b.get_kv(keys), kv)
    finally:
        await b.close()
        await a.close()


async def test_interleaved_and_restreamed_layer_puts(region_path: str, backend: str) -> None:
    """Later layers find the reservations of their put (``BlockLifecycle.filling``): two
    interleaved layer-streamed puts, passed equal but new key lists, then a put abandoned after
    its first layer and streamed again from layer 1. Every byte the other node reads is the
    right one (a stale lookup here would publish layers of evicted entries)."""
    a, b = await _pair(region_path, backend)
    try:
        ka = a.block_keys(range(16 * TINY.block_tokens))
        kb = a.block_keys(range(1000 * TINY.block_tokens, 1016 * TINY.block_tokens))
        va, vb = kv_for_keys(ka), kv_for_keys(kb)
        blocks = a._store.blocks
        await a.put_kv(ka, va[0].contiguous(), layer=0)
        await a.put_kv(list(kb), vb[0].contiguous(), layer=0)       # the record is now kb's
        for layer in range(1, TINY.num_layers):
            await a.put_kv(list(ka), va[layer].contiguous(), layer=layer)   # equal, new lists
            await a.put_kv([bytes(k) for k in kb], vb[layer].contiguous(), layer=layer)
        assert blocks.in_flight == 0
        assert torch.equal(await b.get_kv(ka), va) and torch.equal(await b.get_kv(kb), vb)

        kc = a.block_keys(range(2000 * TINY.block_tokens, 2016 * TINY.block_tokens))
        vc = kv_for_keys(kc)
        await a.put_kv(kc, vc[0].contiguous(), layer=0)
        await blocks.abandon(kc)                       # evicted: the record must go with them
        assert blocks.in_flight == 0
        for layer in (1, 0, 2, 3):                     # reserved again by the layer-1 put
            await a.put_kv(kc, vc[layer].contiguous(), layer=layer)
        assert blocks.in_flight == 0
        assert torch.equal(await b.get_kv(kc), vc)
    finally:
        await b.close()
        await a.close()


async def test_bad_input_changes_nothing(region_path: str, transport: str) -> None:
    a, b = await _pair(region_path, "hw", transport)
    try:
        keys = a.block_keys(range(32))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        before = _index_state(a)
        with pytest.raises(E.TensorMismatch, match=r"expected \(4, 2, 32, 2, 32\)"):
            await a.put_kv(keys, kv[:, :, :16])
        with pytest.raises(E.TensorMismatch, match="dtype torch.float16"):
            await a.put_kv(keys, kv.half())
        with pytest.raises(E.TensorMismatch, match="one layer"):
            await a.put_kv(keys, kv, layer=0)
        with pytest.raises(E.TensorMismatch, match="layer must be in 0..3"):
            await a.put_kv(keys, kv[0], layer=7)
        with pytest.raises(E.TensorMismatch, match="meta"):
            await a.put_kv(keys, kv.to("meta"))
        with pytest.raises(E.KeyMismatch, match="32-byte"):
            await a.put_kv([b"x" * 31, keys[1]], kv)
        with pytest.raises(E.KeyMismatch, match="single bytes"):
            a.lookup(keys[0])
        unknown = a.block_keys(range(1000, 1032))
        with pytest.raises(E.BlockNotFound, match="not in the region"):
            await b.get_kv(unknown)
        with pytest.raises(E.TransferTimeout, match="did not appear"):
            await b.get_kv(unknown, timeout=0.2)
        with pytest.raises(E.TensorMismatch, match="out has shape"):
            await b.get_kv(keys, out=torch.empty(3))
        assert _index_state(a) == before
    finally:
        await b.close()
        await a.close()


async def test_layer_not_ready_and_timeout(region_path: str, transport: str) -> None:
    a, b = await _pair(region_path, "sim", transport)
    try:
        keys = a.block_keys(range(16))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv[0].contiguous(), layer=0)
        with pytest.raises(E.LayerNotReady, match="layer 1"):
            await b.get_kv(keys, layer=1)
        with pytest.raises(E.LayerNotReady, match="still being produced"):
            await b.get_kv(keys)
        with pytest.raises(E.TransferTimeout, match="layer 3"):
            await b.get_kv(keys, layer=3, timeout=0.2)
    finally:
        await b.close()
        await a.close()


async def test_region_full_is_all_or_nothing(region_path: str, transport: str) -> None:
    # 4 MiB region with 1 MiB chunks: a few dozen 32 KiB blocks at most (HTTP: a 4 MiB pool,
    # 128 slots, and transfer mode evicts nothing for space)
    a = await _one(region_path, transport, region_bytes=4 << 20, mode="transfer")
    try:
        keys = a.block_keys(range(16 * 200))
        before = _index_state(a)
        with pytest.raises(E.RegionFull):
            await a.put_kv(keys, kv_for_keys(keys))
        assert _index_state(a) == before, "a failed put must leave the index and heaps as they were"
        small = keys[:4]
        assert await a.put_kv(small, kv_for_keys(small)) == 4   # still usable afterwards
    finally:
        await a.close()


@pytest.mark.parametrize("n", [2, 12])
async def test_a_read_is_stamped_when_it_happened_not_when_it_is_flushed(region_path: str,
                                                                        n: int) -> None:
    """Blocks read before other blocks were written are the older for the LRU, however late
    their reads are stamped: reads are stamped at a later maintenance or locked reservation,
    with the time each was recorded (``stores/touches.py``). Stamped with the flush's time, the
    blocks just written looked the older and were the victims (the sampled LRU then took a
    request's blocks while it was reading them). ``n`` 2: the small reads' records; 12: the
    large reads' arrays, layer by layer."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        b = eng._store.blocks
        old = eng.block_keys(list(range(16 * n)))
        await eng.put_kv(old, kv_for_keys(old))
        if n <= 8:
            await eng.get_kv(old)
        else:
            for layer in range(TINY.num_layers):
                await eng.get_kv(old, layer=layer)
        await asyncio.sleep(0.005)
        new = eng.block_keys(list(range(100_000, 100_000 + 16 * n)))
        await eng.put_kv(new, kv_for_keys(new))      # written after the reads
        await asyncio.sleep(0.005)
        b.touches.flush()                             # the reads reach the region now
        import tract_kernels as K
        from tract_async.region import index as ix
        eoff = b.index.geo.entries_offset

        def stamps(keys: list[bytes]) -> list[int]:
            snap = b.index.snapshot(keys_to_words(keys))
            return [int(K.load(b.mem, eoff + int(s) * ix.ENTRY_BYTES + ix.E_LAST))
                    for s in snap[:, 0]]
        assert max(stamps(old)) < min(stamps(new))
        await b.lock.acquire(timeout=5)               # the LRU takes the blocks read before
        try:
            assert b.evict_lru_locked(n) == n
        finally:
            b.lock.release()
        assert eng.lookup(old) == 0 and eng.lookup(new) == n


@pytest.mark.parametrize("nhot", [4, 12])
async def test_lru_eviction_keeps_recent_blocks(region_path: str, transport: str,
                                                nhot: int) -> None:
    """``nhot`` 12: more than SMALL_READ blocks, read layer by layer (the touches of large
    reads are kept as arrays, once per layer, and stamped once per block at the flush)."""
    # HTTP: a pool of 4 MiB (128 slots) fills within the rounds below, as the region does
    extra = {"http_pool_bytes": 4 << 20} if transport in NET else {}
    a = await _one(region_path, transport, region_bytes=6 << 20, **extra)

    async def read_hot() -> None:
        if nhot <= 8:
            await a.get_kv(hot)
            return
        for layer in range(TINY.num_layers):
            await a.get_kv(hot, layer=layer)
    try:
        per = 16
        first = a.block_keys(range(16 * per))
        await a.put_kv(first, kv_for_keys(first))
        hot = first[:nhot]
        for _ in range(3):
            await read_hot()
        await a._store.maintain(timeout=5)     # touches reach the region under the lock
        stored = list(first)
        for r in range(1, 12):               # keep putting until the region has evicted
            more = a.block_keys(range(10_000 * r, 10_000 * r + 16 * per))
            await a.put_kv(more, kv_for_keys(more))
            stored += more
            for _ in range(2):
                await read_hot()
            await a._store.maintain(timeout=5)
            if a.stats()["evictions_for_space"] > 2 * per:
                break
        st = a.stats()
        assert st["evictions_for_space"] > 0
        assert a.lookup(hot) == nhot, "recently used blocks must survive sampled-LRU eviction"
        cold_left = sum(a.lookup([k]) for k in first[nhot:])
        assert cold_left < len(first) - nhot
        got = await a.get_kv(hot)
        assert all(block_matches(hot, got))
    finally:
        await a.close()


async def _fill_with_node0(a: tract.Engine) -> list[bytes]:
    stored: list[bytes] = []
    for r in range(40):                                   # until node 0 owns every chunk
        keys = a.block_keys(range(10_000 * r, 10_000 * r + 16 * 16))
        await a.put_kv(keys, kv_for_keys(keys))
        stored += keys
        if a._store.alloc.table.find_free() is None and a.stats()["evictions_for_space"]:
            break
    assert a._store.alloc.table.find_free() is None, "the region never filled"
    return stored


async def test_a_node_without_a_chunk_gets_one_from_the_owner(region_path: str) -> None:
    """Node 0 owns every chunk of a full region. Node 1's put does not evict node 0's blocks
    (their slots would go back to node 0: evicting only emptied everyone's cache, ~20 000 blocks
    in one 30 s stress); it asks for a chunk, and node 0 -- owning more than its fair share --
    evicts the blocks of its least used chunk and releases it. Node 1's put then succeeds, node
    0 lost only that chunk's blocks, and reads of the rest still work."""
    a = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=6 << 20))
    b = None
    try:
        stored = await _fill_with_node0(a)
        chunks_a = len(a._store.alloc.owned_chunks())
        b = await tract.Engine.open(cfg(region_path, 1))
        present = [k for k in stored if a.lookup([k])]
        assert len(present) > 16
        mine = b.block_keys(range(900_000, 900_000 + 16 * 2))
        assert await b.put_kv(mine, kv_for_keys(mine), timeout=10) == 2
        assert all(block_matches(mine, await a.get_kv(mine)))
        sb, sa = b.stats(), a.stats()
        assert sb["evictions"] == 0 and sb["full_without_chunk"] >= 1, sb
        assert len(b._store.alloc.owned_chunks()) == 1
        assert sa["chunks_given"] == 1 and len(a._store.alloc.owned_chunks()) == chunks_a - 1
        lost = [k for k in present if not a.lookup([k])]
        assert len(lost) == sa["evictions_for_others"] <= 32, (len(lost), sa)   # one chunk's
        rest = [k for k in present if a.lookup([k])][-4:]
        assert all(block_matches(rest, await b.get_kv(rest)))     # reads still work
        assert b.stats()["evictions"] == 0
    finally:
        if b is not None:
            await b.close()
        await a.close()


async def test_a_starving_node_gets_a_chunk_while_the_owner_keeps_putting(
        region_path: str) -> None:
    """The restarted-node case: the survivor keeps putting (evicting its own LRU blocks) while
    the newcomer asks; the newcomer's put still succeeds, within the put's wait."""
    a = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=6 << 20))
    b = None
    stop = asyncio.Event()

    async def keep_putting() -> int:
        r = 100
        while not stop.is_set():
            keys = a.block_keys(range(10_000 * r, 10_000 * r + 16 * 8))
            await a.put_kv(keys, kv_for_keys(keys))
            r += 1
            await asyncio.sleep(0)
        return r - 100

    try:
        await _fill_with_node0(a)
        b = await tract.Engine.open(cfg(region_path, 1))
        writer = asyncio.create_task(keep_putting())
        await asyncio.sleep(0.2)
        mine = b.block_keys(range(900_000, 900_000 + 16 * 4))
        assert await b.put_kv(mine, kv_for_keys(mine), timeout=10) == 4
        stop.set()
        assert await writer > 2
        assert all(block_matches(mine, await b.get_kv(mine)))
        assert b.stats()["evictions"] == 0 and a.stats()["chunks_given"] >= 1
    finally:
        stop.set()
        if b is not None:
            await b.close()
        await a.close()


@pytest.mark.parametrize("wait", [pytest.param(True, id="delivered"),
                                  pytest.param(False, id="negative-control",
                                               marks=pytest.mark.fsck_dirty)])
async def test_a_consumers_close_delivers_its_returns(region_path: str, wait: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Transfer-only mode: a consumer that read (and so freed) more of a producer's blocks than
    the producer's return ring holds still delivers every return at its close, once the
    producer's maintenance has drained the ring; the producer then releases all its chunks
    (fsck clean). The negative control closes without waiting: the producer's chunks leak."""
    if not wait:
        monkeypatch.setattr(bfb, "RETURN_WAIT_S", 0.0)
    a, b = await _pair(region_path, "hw", mode="transfer")
    try:
        n = 480                                   # > the 128 entries of a ring
        keys = a.block_keys(range(n * TINY.block_tokens))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        assert torch.equal(await b.get_kv(keys), kv)
        assert b.stats()["consumed"] == n and b._store.alloc.pending_returns() > 0
    finally:
        await b.close()
        await a.close()
    rep = run_fsck(region_path)
    if wait:
        assert rep.clean, rep.text()
    else:
        assert not rep.clean and "leak" in rep.text()


async def test_transfer_only_mode_frees_on_consume_and_deadline(region_path: str,
                                                                 transport: str) -> None:
    # the deadline must outlast the layer-by-layer reads below: at 0.3 s, beside two busy loops
    # (.ci/busy-run), the HTTP pair's four layer reads took longer and the blocks expired
    # between them (BlockEvicted at layer 3); the expiry itself is checked at the end
    a, b = await _pair(region_path, "hw", transport, mode="transfer", transfer_deadline_s=1.5)
    try:
        keys = a.block_keys(range(48))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        assert b.lookup(keys) == 3
        assert torch.equal(await b.get_kv(keys), kv)
        assert b.lookup(keys) == 0 and b.stats()["consumed"] == 3
        # layer-by-layer consumption frees after the last layer
        k2 = a.block_keys(range(100, 132))
        kv2 = kv_for_keys(k2)
        await a.put_kv(k2, kv2)
        for layer in range(TINY.num_layers):
            assert torch.equal(await b.get_kv(k2, layer=layer), kv2[layer])
        assert b.lookup(k2) == 0
        # nobody consumes: freed after the deadline by maintenance
        k3 = a.block_keys(range(200, 232))
        await a.put_kv(k3, kv_for_keys(k3))
        assert a.lookup(k3) == 2
        for _ in range(100):
            await asyncio.sleep(0.05)
            if a.lookup(k3) == 0:
                break
        assert a.lookup(k3) == 0
        assert a.stats()["expired"] + b.stats()["expired"] == 2
    finally:
        await b.close()
        await a.close()


async def test_cancelled_put_releases_its_reservation(region_path: str) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True))
    try:
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv[0].contiguous(), layer=0)
        assert a.stats()["reserved_in_flight"] == 4
        await a.close()
        b = await tract.Engine.open(cfg(region_path, 1))
        try:
            table = b._store.index.scan()
            assert not (table[:, 0] == 1).any(), "close must evict unfinished reservations"
            assert b.lookup(keys) == 0
        finally:
            await b.close()
    finally:
        await a.close()


async def test_closed_engine_and_stats(region_path: str) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True))
    s = a.stats()
    assert s["open"] and s["transport"] == "region" and "lock" in s and "index" in s
    await a.close()
    await a.close()   # idempotent
    with pytest.raises(E.EngineClosed):
        a.lookup([])
    with pytest.raises(E.RegionExists):
        await tract.Engine.open(cfg(region_path, 0, create=True))


def test_config_errors() -> None:
    with pytest.raises(E.ConfigError, match="mode"):
        tract.EngineConfig(layout=TINY, region="/dev/shm/x", mode="bogus")
    with pytest.raises(E.ConfigError, match="node_id 9 must be below max_nodes 8"):
        tract.EngineConfig(layout=TINY, region="/dev/shm/x", node_id=9)
    with pytest.raises(E.ConfigError, match="num_layers"):
        tract.KVLayout(num_layers=0, block_tokens=16, kv_heads=1, head_dim=8)
    big = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128)
    assert big.block_bytes == 2 << 20 and big.layer_bytes == 64 << 10
    with pytest.raises(E.ConfigError, match="exceeds chunk_bytes"):
        tract.EngineConfig(layout=big, region="/dev/shm/x", chunk_bytes=1 << 20)


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "negative-control"])
async def test_revalidation_is_what_stops_a_torn_read(region_path: str, validate: bool) -> None:
    """Node B snapshots block X and is paused before its copy; node A evicts X and reuses its slot
    for another key's bytes; B resumes. With the post-copy revalidation B reports BlockEvicted;
    without it (the negative control) B returns the other key's bytes as X's."""
    a = await tract.Engine.open(cfg(region_path, 0, create=True, backend="sim"))
    b = await tract.Engine.open(cfg(region_path, 1, backend="sim"))
    try:
        x = a.block_keys(range(16))
        await a.put_kv(x, kv_for_keys(x))
        snap_x = a._store.index.snapshot(keys_to_words(x))
        slot, x_payload = int(snap_x[0, 0]), int(snap_x[0, 3])
        at_copy, resume = asyncio.Event(), asyncio.Event()

        async def pause() -> None:
            at_copy.set()
            await resume.wait()
        b._store.blocks.pause_after_snapshot = pause
        b._store.blocks.validate_reads = validate
        reader = asyncio.create_task(b.get_kv(x))
        await asyncio.wait_for(at_copy.wait(), 30)
        # A evicts X under the lock; its slot goes back to A's free list and is reused at once
        st = a._store
        assert await st.blocks.evict(x, timeout=10) == 1
        y = a.block_keys(range(5000, 5016))
        await a.put_kv(y, kv_for_keys(y))
        assert int(st.index.snapshot(keys_to_words(y))[0, 3]) == x_payload, \
            "Y must have been written into X's old payload slot"
        resume.set()
        if validate:
            with pytest.raises(E.BlockEvicted, match="evicted while being read"):
                await reader
            assert b.stats()["validation_failures"] == 1
        else:
            got = await reader
            assert not any(block_matches(x, got)), "X's bytes were read: the slot was not reused"
            assert all(block_matches(y, got)), "expected exactly Y's bytes in X's place"
    finally:
        await b.close()
        await a.close()


@njit(cache=False)            # no nogil: this call keeps the GIL for its whole duration
def _hold_gil_for(ns: int) -> int:
    end = monotonic_ns() + ns
    n = 0
    while monotonic_ns() < end:
        n += 1
    return n


async def test_heartbeat_survives_a_stall_that_holds_the_gil(region_path: str) -> None:
    """A process stalled with the GIL held (a long numba compile, a C call that keeps it) for
    three liveness timeouts is still live: the heartbeat runs in jitted code without the GIL.
    (A Python heartbeat thread beat 0-1 times here, and the lock manager revoked the node.)"""
    # cfg: heartbeat every 50 ms
    async with tract.Engine.open(cfg(region_path, 0, create=True, liveness_timeout_s=0.4)) as eng:
        nodes = eng._region.nodes
        seq0 = nodes.info(0).heartbeat_seq
        _hold_gil_for(int(1.2e9))
        after = nodes.info(0, timeout_s=0.4)
        assert after.live, f"heartbeat age {after.heartbeat_age_s:.3f} s after the stall"
        assert after.heartbeat_seq - seq0 >= 12, (seq0, after.heartbeat_seq)   # ~24 expected
        keys = eng.block_keys(range(16))
        await eng.put_kv(keys, kv_for_keys(keys))            # the node still writes


async def test_a_large_put_in_a_fresh_region_is_one_contiguous_run(region_path: str) -> None:
    """Blocks of one put run up through the freshly claimed chunks in address order, so the
    whole payload is one contiguous range (one DMA on the GPU path, not one per chunk)."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        bb = eng.layout.block_bytes
        per_chunk = (1 << 20) // bb                         # cfg: 1 MiB chunks
        keys = eng.block_keys(range(TINY.block_tokens * per_chunk * 3))   # three chunks' worth
        assert await eng.put_kv(keys, kv_for_keys(keys)) == len(keys)
        snap = eng._store.index.snapshot(keys_to_words(keys))
        poffs = snap[:, 3]
        assert (np.diff(poffs) == bb).all(), np.unique(np.diff(poffs))


@pytest.mark.parametrize("copy_threads", [1, 2])
async def test_large_get_is_exact_with_one_or_two_copy_threads(region_path: str,
                                                               copy_threads: int) -> None:
    """Reads of >= 8 MiB: with two copy threads the rows are cut into two groups, each read
    on its own thread (``stores/region.py``); the bytes are the same either way."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=copy_threads,
                                     region_bytes=64 << 20)) as eng:
        n = (9 << 20) // eng.layout.block_bytes
        keys = eng.block_keys(range(TINY.block_tokens * n))
        kv = kv_for_keys(keys)
        await eng.put_kv(keys, kv)
        out = torch.empty_like(kv)
        assert (await eng.get_kv(keys, out=out)) is out
        assert torch.equal(out, kv)


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_small_whole_block_transfers_take_one_kernel_call(region_path: str,
                                                                backend: str) -> None:
    """Puts and gets of at most FUSED_MAX_BLOCKS whole blocks run as one fused kernel call
    (``stores/fused.py``) once the node has its lane; layer puts, larger puts and a get that
    must wait first take the step-by-step path or wait and then fuse. Bytes match everywhere;
    spare slots go back to the free lists."""
    from tract_async.region import index as ix
    from tract_async.stores.fused import FUSED_MAX_BLOCKS
    a, b = await _pair(region_path, backend)
    try:
        first = a.block_keys(range(16))
        await a.put_kv(first, kv_for_keys(first))          # takes the lane: the locked path
        sa, sb = a._store.stats, b._store.stats
        f0 = sa.fused_puts
        small = a.block_keys(range(1000, 1000 + 16 * FUSED_MAX_BLOCKS))
        kv = kv_for_keys(small)
        assert await a.put_kv(small, kv) == FUSED_MAX_BLOCKS
        assert sa.fused_puts == f0 + 1
        assert torch.equal(await b.get_kv(small), kv) and sb.fused_gets == 1
        assert await a.put_kv(small, kv) == 0 and sa.fused_puts == f0 + 2   # all present
        big = a.block_keys(range(5000, 5000 + 16 * (FUSED_MAX_BLOCKS + 1)))
        await a.put_kv(big, kv_for_keys(big))
        assert sa.fused_puts == f0 + 2
        assert torch.equal(await b.get_kv(big), kv_for_keys(big)) and sb.fused_gets == 1
        lay = a.block_keys(range(9000, 9032))
        kl = kv_for_keys(lay)
        waiter = asyncio.create_task(b.get_kv(lay, timeout=20.0))     # waits, then fuses
        await asyncio.sleep(0.02)
        for layer in range(TINY.num_layers):
            await a.put_kv(lay, kl[layer].contiguous(), layer=layer)
        assert sa.fused_puts == f0 + 2
        assert torch.equal(await asyncio.wait_for(waiter, 20), kl) and sb.fused_gets == 2
        assert len(a._store.blocks.spares), "a fused put keeps spare slots"
        a._store.blocks.drop_spares()
        table = a._store.index.scan()
        mine = int(((table[:, 0] == ix.READY) & ((table[:, 6] & 0xFFFF) == 0)).sum())
        assert a._store.alloc.statistics().slots_used == mine
    finally:
        await b.close()
        await a.close()


async def test_a_prompt_shorter_than_a_block_has_no_keys_and_the_error_says_so(
        region_path: str) -> None:
    """block_keys keys full blocks only: a prompt shorter than a block gets none, and a put or
    get of its KV says so instead of "expected (...) for 0 blocks"; a trailing partial block
    is named too."""
    T = TINY.block_tokens

    def kv_of(tokens: int, layer: int | None = None) -> np.ndarray:
        shape = list(TINY.kv_shape(1, layer))
        shape[2 if layer is None else 1] = tokens
        return np.zeros(shape, dtype=np.float32)
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a:
        keys = a.block_keys(range(T - 6))
        assert keys == []
        short = f"shorter than one block of {T} tokens \\({T - 6} here\\)"
        with pytest.raises(E.TensorMismatch, match=short):
            await a.put_kv(keys, kv_of(T - 6))
        with pytest.raises(E.TensorMismatch, match=short):
            await a.put_kv(keys, kv_of(T - 6, 0), layer=0)
        with pytest.raises(E.TensorMismatch, match=short):
            await a.get_kv(keys, out=kv_of(T - 6))
        keys = a.block_keys(range(2 * T + 5))
        with pytest.raises(E.TensorMismatch, match=f"2 full blocks and 5 more.*first {2 * T} "):
            await a.put_kv(keys, kv_of(2 * T + 5))
        with pytest.raises(E.TensorMismatch, match="expected") as got:
            await a.put_kv(keys, kv_of(T))          # fewer tokens than keys: no hint
        assert "block_keys" not in str(got.value)
        assert await a.put_kv(keys, kv_of(2 * T)) == 2
