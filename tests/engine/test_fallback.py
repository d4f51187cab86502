"""Region engines fall back to HTTP per transfer: attach failure, RegionFull, a foreign rack.

Each test runs real Agents on 127.0.0.1 (port 0) next to real /dev/shm regions, and checks the
bytes, where they travelled (``stats()['fallbacks']``, the HTTP counters), and what the region
holds.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

import tract_async as tract
from tract_async import errors as E
from tests.support import engine_http_util as U
from tests.support.engine_http_util import http_cfg
from tests.support.engine_util import TINY, kv_for_keys


async def test_attach_failure_runs_the_engine_on_http(region_path: str) -> None:
    a = await tract.Engine.open(http_cfg(0, region=region_path, create=True))
    assert a.stats()["transport"] == f"region+{U.TRANSPORT}"
    missing = region_path + "-missing"
    with pytest.raises(E.RegionNotFound):      # fallback=False: the error stands
        await tract.Engine.open(http_cfg(1, region=missing, peers=[a.url], fallback=False))
    b = await tract.Engine.open(http_cfg(1, region=missing, peers=[a.url]))
    try:
        sb = b.stats()
        assert sb["transport"] == U.TRANSPORT and sb["fallbacks"] == {"attach": 1}
        assert "RegionNotFound" in b.fallback_reason and b.region is None
        # a sees b outside its rack: a's puts also go to its HTTP pool, b reads them there
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        assert await a.put_kv(keys, kv) == 4
        assert a.stats()["fallbacks"] == {"foreign_rack": 1}
        assert b.lookup(keys) == 4
        assert torch.equal(await b.get_kv(keys), kv)
        assert b.stats()["blocks_read_foreign"] == 4
        # and b's puts reach a over HTTP
        k2 = b.block_keys(range(500, 532))
        await b.put_kv(k2, kv_for_keys(k2))
        assert a.lookup(k2) == 2 and torch.equal(await a.get_kv(k2), kv_for_keys(k2))
    finally:
        await b.close()
        await a.close()


async def test_region_full_spills_to_http(region_path: str) -> None:
    # 4 MiB region, transfer mode: nothing is evicted for space, ~100 blocks fit at most
    kw = dict(region_bytes=4 << 20, mode="transfer", http_pool_bytes=16 << 20)
    a = await tract.Engine.open(http_cfg(0, region=region_path, create=True, **kw))
    b = await tract.Engine.open(http_cfg(1, region=region_path, peers=[a.url], **kw))
    try:
        small = a.block_keys(range(10_000, 10_064))
        assert await a.put_kv(small, kv_for_keys(small)) == 4       # fits: region only
        assert a.stats()["fallbacks"] == {} and a.stats()["http"]["blocks_stored"] == 0
        keys = a.block_keys(range(16 * 200))
        kv = kv_for_keys(keys)
        waiter = asyncio.create_task(b.get_kv(keys, layer=3, timeout=30))
        for layer in range(TINY.num_layers):       # layer 0 hits RegionFull; the rest follow it
            assert await a.put_kv(keys, kv[layer].contiguous(), layer=layer) == 200
        sa = a.stats()
        assert sa["fallbacks"] == {"region_full": 4}
        assert sa["http"]["blocks_stored"] == 200 and sa["blocks_stored"] == 4
        assert b.lookup(keys) == 200 and b.lookup(small) == 4
        assert torch.equal(await asyncio.wait_for(waiter, 30), kv[3])
        # one get spanning region and HTTP blocks: split into runs, each read where it lives
        mixed = small + keys[:3]
        want = torch.cat([kv_for_keys(small), kv[:, :, :48]], dim=2)
        assert torch.equal(await b.get_kv(mixed), want)
        sb = b.stats()
        assert sb["http"]["blocks_read_remote"] >= 3 and sb["fallbacks"] == {}
        assert b.lookup(small) == 0 and b.lookup(keys[:3]) == 0, "transfer mode: consumed"
    finally:
        await b.close()
        await a.close()


async def test_region_full_without_http_still_raises(region_path: str) -> None:
    from tests.support.engine_util import cfg
    a = await tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=4 << 20,
                                    mode="transfer", peers=()))
    try:
        assert a.stats()["transport"] == "region"
        keys = a.block_keys(range(16 * 200))
        with pytest.raises(E.RegionFull):
            await a.put_kv(keys, kv_for_keys(keys))
    finally:
        await a.close()


async def test_peer_of_another_rack_is_read_over_http(region_path: str) -> None:
    rack2 = region_path + "-rack2"
    a = await tract.Engine.open(http_cfg(0, region=region_path, create=True))
    c = await tract.Engine.open(http_cfg(1, region=region_path, peers=[a.url]))   # a's rack
    b = await tract.Engine.open(http_cfg(0, region=rack2, create=True, peers=[a.url, c.url]))
    try:
        assert a.region.uuid != b.region.uuid
        keys = a.block_keys(range(80))
        kv = kv_for_keys(keys)
        waiting = asyncio.create_task(b.get_kv(keys, timeout=30))   # before anything exists
        await asyncio.sleep(0)
        assert await a.put_kv(keys, kv) == 5
        assert a.stats()["fallbacks"] == {"foreign_rack": 1}, "exported for b only"
        assert torch.equal(await asyncio.wait_for(waiting, 30), kv)
        sb = b.stats()
        assert sb["fallbacks"]["foreign_rack"] >= 1 and sb["http"]["blocks_read_foreign"] == 5
        assert b.lookup(keys) == 5
        # same rack: c reads a's blocks from the region, not over HTTP
        assert torch.equal(await c.get_kv(keys), kv)
        sc = c.stats()
        assert sc["hits"] == 5 and sc["http"]["blocks_read_remote"] == 0 and sc["fallbacks"] == {}
    finally:
        await b.close()
        await c.close()
        await a.close()


def test_every_store_implements_the_store_protocol() -> None:
    """One typed interface (``stores/protocol.py``) for the region, network and fallback
    stores: the Engine dispatches CPU and CUDA transfers through it alike."""
    from tract_async.stores.fallback import FallbackStore
    from tract_async.stores.http import HttpStore
    from tract_async.stores.protocol import Store
    from tract_async.stores.region import RegionStore
    for cls in (RegionStore, HttpStore, FallbackStore):
        for name in ("lookup", "put", "get", "maintain"):
            assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name}"
            assert asyncio.iscoroutinefunction(getattr(cls, name)) == \
                asyncio.iscoroutinefunction(getattr(Store, name)), f"{cls.__name__}.{name}"


@pytest.mark.gpu
async def test_region_full_spills_cuda_puts_to_http(region_path: str) -> None:
    """A CUDA put that hits RegionFull takes the same fallback as a CPU put (it used to raise:
    the CUDA path bypassed the store dispatch), and a CUDA get reads the spilled blocks back."""
    kw = dict(region_bytes=4 << 20, mode="transfer", http_pool_bytes=16 << 20)
    a = await tract.Engine.open(http_cfg(0, region=region_path, create=True, **kw))
    b = await tract.Engine.open(http_cfg(1, region=region_path, peers=[a.url], **kw))
    try:
        keys = a.block_keys(range(16 * 200))
        kv = kv_for_keys(keys)
        assert await a.put_kv(keys, kv.cuda()) == 200
        sa = a.stats()
        assert sa["fallbacks"] == {"region_full": 1} and sa["http"]["blocks_stored"] == 200
        got = await b.get_kv(keys, device="cuda")
        assert got.is_cuda and torch.equal(got.cpu(), kv)
    finally:
        await b.close()
        await a.close()
