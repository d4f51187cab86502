"""Staged whole-block CUDA transfers on a real device (``cuda/store.py``, "Staged whole
prompts"): bit-exact put and get in stages, one transaction per stage, the stages' direct and
gather copies mixed, a stage that fails part-way, consumption in transfer mode.

The thresholds are lowered (``routing``) so that the test layout's 256 KiB blocks stage at 16
blocks. Sync tests around asyncio.run. Skipped without CUDA; run with ``bench/gpu_suite.sh``.
"""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

import tract_async as tract
from tract_async.errors import BlockNotFound
from tract_async.stores import routing as R
from tract_async.stores.txn import PutTxn, ReadTxn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAY = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16)          # 256 KiB blocks


@pytest.fixture(autouse=True)
def small_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R, "CUDA_STAGE_FIRST_BYTES", 4 * LAY.block_bytes)
    monkeypatch.setattr(R, "CUDA_STAGE_MIN_BYTES", 16 * LAY.block_bytes)
    assert R.cuda_stages(LAY, 40, None) == [(0, 4), (4, 16), (16, 40)]


def cfg(path: str, **kw) -> tract.EngineConfig:
    return tract.EngineConfig(region=path, region_bytes=256 << 20, create=True, node_id=0,
                              layout=LAY, namespace="gpu-staged", **kw)


def rand_kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAY.kv_shape(n), generator=g).to(LAY.dtype).cuda()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def tokens(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 50000 for i in range(n * LAY.block_tokens)]


def opened() -> tuple[Counter, Counter]:
    return Counter(PutTxn.opened), Counter(ReadTxn.opened)


def test_a_staged_put_and_get_are_exact_one_transaction_per_stage(region_path):
    async def main():
        async with tract.Engine.open(cfg(region_path)) as eng:
            n = 40
            keys = eng.block_keys(tokens(n, 1))
            kv = rand_kv(n, 1)
            p0, r0 = opened()
            fut = await eng.start_put_kv(keys, kv)
            assert fut.label == "put/staged"
            assert await fut == n
            out = torch.zeros_like(kv)
            fut = await eng.start_get_kv(keys, out=out)
            assert fut.label == "get/staged"
            await fut
            assert same_bits(out, kv)
            p1, r1 = opened()
            assert dict(p1 - p0) == {"cuda-stage": 3} and dict(r1 - r0) == {"cuda-stage": 3}
            assert same_bits((await eng.get_kv(keys)).cuda(), kv)   # the CPU path agrees
            assert eng.stats()["cuda"]["outstanding"] == 0
    asyncio.run(main())


def test_a_staged_put_of_partly_present_keys_mixes_direct_and_gather_copies(region_path):
    async def main():
        async with tract.Engine.open(cfg(region_path)) as eng:
            n = 40
            keys = eng.block_keys(tokens(n, 2))
            kv = rand_kv(n, 2)
            T = LAY.block_tokens
            # blocks 6..9 (in the second stage) present already: that stage is not whole
            assert await eng.put_kv(keys[6:10], kv[:, :, 6 * T:10 * T].contiguous()) == 4
            fut = await eng.start_put_kv(keys, kv)
            assert await fut == n - 4
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
    asyncio.run(main())


def test_a_staged_get_that_fails_part_way_returns_once_its_bytes_landed(region_path):
    """The last stage's blocks are missing: the get raises BlockNotFound only after the
    stages already enqueued have landed in ``out``; nothing is left outstanding."""
    async def main():
        async with tract.Engine.open(cfg(region_path)) as eng:
            n = 40
            keys = eng.block_keys(tokens(n, 3))
            kv = rand_kv(n, 3)
            assert await eng.put_kv(keys[:30], kv[:, :, :30 * LAY.block_tokens].contiguous()) == 30
            out = torch.zeros_like(kv)
            with pytest.raises(BlockNotFound):
                await eng.start_get_kv(keys, out=out)
            st = eng.stats()["cuda"]
            assert st["outstanding"] == 0
            T = LAY.block_tokens
            assert same_bits(out[:, :, :16 * T], kv[:, :, :16 * T])   # the first two stages
    asyncio.run(main())


def test_a_staged_consuming_get_frees_every_stage_in_transfer_mode(region_path):
    async def main():
        async with tract.Engine.open(cfg(region_path, mode="transfer")) as eng:
            n = 40
            keys = eng.block_keys(tokens(n, 4))
            kv = rand_kv(n, 4)
            await eng.put_kv(keys, kv)
            got = await eng.get_kv(keys, device="cuda")
            assert same_bits(got, kv)
            assert eng.lookup(keys) == 0
    asyncio.run(main())


def test_staging_off_by_environment(region_path, monkeypatch):
    monkeypatch.setenv(R.CUDA_STAGES_ENV, "0")

    async def main():
        async with tract.Engine.open(cfg(region_path)) as eng:
            n = 40
            keys = eng.block_keys(tokens(n, 5))
            kv = rand_kv(n, 5)
            fut = await eng.start_put_kv(keys, kv)
            assert fut.label != "put/staged"
            await fut
            out = torch.zeros_like(kv)
            fut = await eng.start_get_kv(keys, out=out)
            assert fut.label == "get/direct"
            await fut
            assert same_bits(out, kv)
    asyncio.run(main())
