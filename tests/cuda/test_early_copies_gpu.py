"""Copies before the entries on a real device (``cuda/store.py``, ``_EarlyPut``; docs/design.md,
"Copies before the entries"): a direct put of many new blocks that reserves lock-free starts
its DMA between taking the slots and placing the entries, bit-exact; a placement that is not
whole (a key another node stored meanwhile) voids the DMA and the put copies again, exact for
its own blocks and leaving the other node's untouched; ``TRACT_CUDA_EARLY=0`` turns it off.

The CPU side of the contract (the reserver's order and its void) is
``tests/engine/test_early_copies.py``. Sync tests around asyncio.run; skipped without CUDA.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

import tract_async as tract
from tract_async.cuda import store as cuda_store
from tests.support.cuda_util import layout, rand_kv, same_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cfg(path: str, lay: tract.KVLayout, node: int, create: bool) -> tract.EngineConfig:
    return tract.EngineConfig(region=path, region_bytes=256 << 20, create=create, node_id=node,
                              layout=lay, namespace="gpu-early", mode="transfer")


def early(eng: tract.Engine) -> dict:
    return eng.stats()["cuda"]["early_puts"]


async def warm(eng: tract.Engine, lay: tract.KVLayout, n: int) -> None:
    """Lane and chunks taken, slots given back (a transfer read frees them): a later put of
    up to ``n`` blocks reserves lock-free."""
    keys = eng.block_keys([90000 + i for i in range(n * lay.block_tokens)])
    kv = rand_kv(lay, n, 1)
    await eng.put_kv(keys, kv)
    out = torch.empty_like(kv)
    await eng.get_kv(keys, out=out)
    assert same_bits(out, kv)


@pytest.mark.parametrize("layered", [False, True])
def test_a_lockfree_put_starts_its_dma_before_its_entries(region_path, layered):
    lay = layout()

    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, lay, 0, True)) as eng:
            await warm(eng, lay, 64)
            st = eng._store.stats
            before, used = st.early_copies, early(eng)["used"]
            keys = eng.block_keys(list(range(40 * lay.block_tokens)))
            kv = rand_kv(lay, 40, 2)
            if layered:            # a layer stream's first layer reserves; later layers resume
                for i in range(lay.num_layers):
                    await (await eng.start_put_kv(keys, kv[i], layer=i))
            else:
                await eng.put_kv(keys, kv)
            assert early(eng)["used"] == used + 1 and st.early_copies == before + 1
            out = torch.empty_like(kv)
            await eng.get_kv(keys, out=out)
            assert same_bits(out, kv)

    asyncio.run(main())


def test_a_placement_that_is_not_whole_voids_the_dma_and_copies_again(region_path):
    lay = layout()

    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, lay, 0, True)) as a, \
                tract.Engine.open(cfg(region_path, lay, 1, False)) as other:
            await warm(a, lay, 100)
            tokens = list(range(80 * lay.block_tokens))
            keys = a.block_keys(tokens)
            kv = rand_kv(lay, 80, 3)
            # the other node stores block 7 first (its own bytes): a's put skips its snapshot
            # (a fresh node's puts found nothing present), so its reservation meets block 7
            # only in the index, after the DMA started
            theirs = rand_kv(lay, 1, 4)
            assert await other.put_kv([keys[7]], theirs) == 1
            st = a._store.stats
            voided, used = st.early_copies_voided, early(a)["used"]
            assert await a.put_kv(keys, kv) == 79
            assert st.early_copies_voided == voided + 1 and early(a)["used"] == used
            mine = [k for i, k in enumerate(keys) if i != 7]
            out = torch.empty(lay.kv_shape(79), dtype=lay.dtype, device="cuda")
            await a.get_kv(mine, out=out)
            want = torch.cat([kv[:, :, :7 * 16], kv[:, :, 8 * 16:]], dim=2)
            assert same_bits(out, want)
            out7 = torch.empty_like(theirs)
            await other.get_kv([keys[7]], out=out7)
            assert same_bits(out7, theirs)

    asyncio.run(main())


def test_early_copies_off(region_path, monkeypatch):
    monkeypatch.setenv(cuda_store.EARLY_ENV, "0")
    lay = layout()

    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, lay, 0, True)) as eng:
            await warm(eng, lay, 64)
            keys = eng.block_keys(list(range(40 * lay.block_tokens)))
            kv = rand_kv(lay, 40, 5)
            await eng.put_kv(keys, kv)
            assert early(eng) == {"on": False, "used": 0}
            out = torch.empty_like(kv)
            await eng.get_kv(keys, out=out)
            assert same_bits(out, kv)

    asyncio.run(main())
