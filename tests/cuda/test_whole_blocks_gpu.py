"""Whole-block transfers one 2-D copy per block (``TRACT_CUDA_WHOLE=blocks``, ``cuda/direct.py``)
on a real device: a whole put and read of evenly spaced and of scattered blocks, bit-exact,
by the direct copies (no gather path), as many driver calls as blocks.

The copies' arithmetic is checked without a GPU in ``test_dma_paths_cpu.py``. Sync tests
around asyncio.run; skipped without CUDA.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

import tract_async as tract
from tract_async.cuda import direct
from tests.support.cuda_util import layout, same_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("scattered", [False, True])
def test_whole_blocks_by_block_copies_are_exact(region_path, monkeypatch, scattered):
    monkeypatch.setenv(direct.WHOLE_ENV, "blocks")
    lay = layout()

    async def main() -> None:
        cfg = tract.EngineConfig(region=region_path, region_bytes=256 << 20, create=True,
                                 node_id=0, layout=lay, namespace="gpu-whole", mode="transfer")
        async with tract.Engine.open(cfg) as eng:
            g = torch.Generator().manual_seed(7)
            if scattered:       # free every other block of a put: the next put's slots scatter
                first = eng.block_keys(list(range(90000, 90000 + 40 * lay.block_tokens)))
                kv0 = torch.randn(lay.kv_shape(40), generator=g).to(lay.dtype).cuda()
                await eng.put_kv(first, kv0)
                out0 = torch.empty(lay.kv_shape(20), dtype=lay.dtype, device="cuda")
                await eng.get_kv(first[::2], out=out0)
            keys = eng.block_keys(list(range(40 * lay.block_tokens)))
            kv = torch.randn(lay.kv_shape(40), generator=g).to(lay.dtype).cuda()
            before = eng.stats()["cuda"] if eng.stats().get("cuda") else None
            calls0 = sum(d["dma2d_calls"] for d in before["devices"].values()) if before else 0
            await eng.put_kv(keys, kv)
            st = eng.stats()["cuda"]
            dev = next(iter(st["devices"].values()))
            assert dev["whole"] == "blocks"
            assert sum(d["dma2d_calls"] for d in st["devices"].values()) - calls0 == 40
            out = torch.empty_like(kv)
            await eng.get_kv(keys, out=out)
            assert same_bits(out, kv)

    asyncio.run(main())
