"""Staged whole-block puts and gets on a real device (``cuda/store.py``, "Staged whole puts",
on through ``TRACT_CUDA_STAGE=1``): exact round trips, keys present already in a later stage, a
later stage that finds no room (nothing stored, the region usable after), a get whose later
stage is missing, and transfer mode's consumption of every stage.

Sync tests around asyncio.run. Skipped without CUDA (conftest); run on the device with
``bench/gpu_suite.sh``.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

import tract_async as tract
from tract_async.errors import BlockNotFound, RegionFull
from tract_async.stores import routing as R

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N = 160
"""Blocks of the staged transfers here: two stages (64, then 96)."""


@pytest.fixture(autouse=True)
def staging_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(R.CUDA_STAGE_ENV, "1")

LAY = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16)          # 2 MiB a block: 64 blocks are 128 MiB


def cfg(path: str, region_mib: int, **kw) -> tract.EngineConfig:
    return tract.EngineConfig(region=path, region_bytes=region_mib << 20, create=True,
                              node_id=0, layout=LAY, namespace="gpu-staged", **kw)


def rand_kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(LAY.kv_shape(n), generator=g, device="cuda").to(LAY.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def keys_for(eng: tract.Engine, n: int, salt: int) -> list[bytes]:
    return eng.block_keys([(salt * 7919 + i) % 50000 for i in range(n * LAY.block_tokens)])


def staged(eng: tract.Engine) -> tuple[int, int, int]:
    c = eng.stats()["cuda"]
    return c["staged_puts"]["puts"], c["staged_puts"]["stages"], c["staged_gets"]


def test_a_large_whole_put_and_get_go_in_stages_and_are_exact(region_path):
    n = N
    assert R.cuda_stageable(LAY, n, None) and R.cuda_stages(n) == [(0, 64), (64, n)]

    async def main():
        async with tract.Engine.open(cfg(region_path, 768)) as eng:
            keys = keys_for(eng, n, 1)
            kv = rand_kv(n, 1)
            assert await eng.put_kv(keys, kv) == n
            assert staged(eng)[:2] == (1, 2)
            assert eng.lookup(keys) == n
            out = torch.zeros_like(kv)
            fut = await eng.start_get_kv(keys, out=out)
            await fut
            assert staged(eng)[2] == 1 and fut.label == "get/staged2"
            assert same_bits(out, kv)
            small = keys_for(eng, 10, 2)                 # below the size: not staged
            assert await eng.put_kv(small, rand_kv(10, 2)) == 10
            assert staged(eng)[:2] == (1, 2)
            assert eng.stats()["cuda"]["outstanding"] == 0
    asyncio.run(main())


def test_keys_present_already_in_a_later_stage_are_skipped_and_the_rest_exact(region_path):
    n = N

    async def main():
        async with tract.Engine.open(cfg(region_path, 768)) as eng:
            keys = keys_for(eng, n, 3)
            kv = rand_kv(n, 3)
            T = LAY.block_tokens
            sub = kv[:, :, 80 * T:100 * T].contiguous()   # blocks 80..99, in stage 2
            assert await eng.put_kv(keys[80:100], sub) == 20
            assert await eng.put_kv(keys, kv) == n - 20
            assert staged(eng)[:2] == (1, 2)
            out = torch.zeros_like(kv)
            await (await eng.start_get_kv(keys, out=out))
            assert same_bits(out, kv)
    asyncio.run(main())


def test_a_later_stage_without_room_stores_nothing_and_frees_the_first(region_path):
    """The region holds ~90 blocks: stage 1 (64) is reserved and copied, stage 2 (96) finds no
    room. RegionFull, no key stored, and a put that fits succeeds after."""
    n = N

    async def main():
        async with tract.Engine.open(cfg(region_path, 200)) as eng:
            keys = keys_for(eng, n, 4)
            kv = rand_kv(n, 4)
            with pytest.raises(RegionFull):
                await eng.put_kv(keys, kv, timeout=1.0)
            assert eng.lookup(keys) == 0
            assert eng.stats()["reserved_in_flight"] == 0
            fit = keys_for(eng, 40, 5)
            kv2 = rand_kv(40, 5)
            assert await eng.put_kv(fit, kv2) == 40
            assert same_bits(await eng.get_kv(fit, device="cuda"), kv2)
    asyncio.run(main())


def test_a_get_whose_later_stage_is_missing_raises_once_its_copies_landed(region_path):
    n = N

    async def main():
        async with tract.Engine.open(cfg(region_path, 768)) as eng:
            keys = keys_for(eng, n, 6)
            kv = rand_kv(n, 6)
            T = LAY.block_tokens
            await eng.put_kv(keys[:100], kv[:, :, :100 * T].contiguous())
            out = torch.zeros_like(kv)
            with pytest.raises(BlockNotFound):
                await eng.get_kv(keys, out=out)
            assert eng.stats()["cuda"]["outstanding"] == 0
            # the first stage's copies landed before the error: they are the stored bytes
            assert same_bits(out[:, :, :64 * T], kv[:, :, :64 * T])
    asyncio.run(main())


def test_transfer_mode_consumes_every_stage(region_path):
    n = N

    async def main():
        async with tract.Engine.open(cfg(region_path, 768, mode="transfer")) as eng:
            keys = keys_for(eng, n, 7)
            kv = rand_kv(n, 7)
            await eng.put_kv(keys, kv)
            out = torch.zeros_like(kv)
            await eng.get_kv(keys, out=out)
            assert same_bits(out, kv)
            await eng._store.blocks.drain_consumed()
            assert eng.lookup(keys) == 0 and eng.lookup(keys[100:]) == 0
            assert await eng.put_kv(keys, kv) == n          # room again for all of them
    asyncio.run(main())
