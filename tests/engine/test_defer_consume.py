"""``EngineConfig.defer_consume``: a consuming read in transfer mode returns before its blocks
are freed, and a background task frees them (one lock hold for every pending batch); nothing
leaks, also when the engine closes with frees still pending."""
from __future__ import annotations

import torch

import tract_async as tract
from tract_async.tools.fsck import run_fsck
from tests.support.engine_util import TINY, cfg, kv_for_keys


async def test_deferred_frees_follow_the_reads_and_nothing_leaks(region_path: str) -> None:
    kw = dict(mode="transfer", defer_consume=True)
    a = await tract.Engine.open(cfg(region_path, 0, create=True, **kw))
    b = await tract.Engine.open(cfg(region_path, 1, **kw))
    try:
        blocks = b._store.blocks
        keys = a.block_keys(range(48))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        assert torch.equal(await b.get_kv(keys), kv)          # whole blocks: consumed
        k2 = a.block_keys(range(100, 132))
        kv2 = kv_for_keys(k2)
        await a.put_kv(k2, kv2)
        for layer in range(TINY.num_layers):                  # the last layer consumes
            assert torch.equal(await b.get_kv(k2, layer=layer), kv2[layer])
        await blocks.drain_consumed()
        assert b.lookup(keys) == 0 and b.lookup(k2) == 0
        assert b.stats()["consumed"] == len(keys) + len(k2)
        assert blocks.stats.deferred_consume_failures == 0
        # a read whose frees are still pending when the engine closes: close frees them first
        k3 = a.block_keys(range(300, 364))
        kv3 = kv_for_keys(k3)
        await a.put_kv(k3, kv3)
        assert torch.equal(await b.get_kv(k3), kv3)
    finally:
        await b.close()
        await a.close()
    rep = run_fsck(region_path)
    assert rep.clean, rep.text()


async def test_without_defer_the_read_frees_before_it_returns(region_path: str) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True, mode="transfer"))
    b = await tract.Engine.open(cfg(region_path, 1, mode="transfer"))
    try:
        keys = a.block_keys(range(48))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        assert torch.equal(await b.get_kv(keys), kv)
        assert b.lookup(keys) == 0 and b.stats()["consumed"] == len(keys)
        assert b._store.blocks.consumer.task is None
    finally:
        await b.close()
        await a.close()
