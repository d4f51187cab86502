"""A region that cannot hold one block of the engine's layout is refused at open, naming the
least ``region_bytes`` (``engine_layout.min_region_bytes``); before, 16 MiB with 2 MiB blocks
and 16 MiB chunks opened and its first put failed with "put at most 0 blocks at a time"."""
from __future__ import annotations

import os

import numpy as np
import pytest

import tract_async as tract
from tract_async import errors as E
from tract_async.engine_layout import (chunk_area_bytes, initialize, min_region_bytes,
                                       region_sections)
from tract_async.region import Region
from tract_async.region.layout import PAGE_BYTES
from tract_async.region.region import min_size_bytes
from tract_async.region import SectionSpec
from tests.support.engine_util import TINY, cfg

BIG = tract.KVLayout(num_layers=16, block_tokens=16, kv_heads=8, head_dim=128, dtype="float32")
assert BIG.block_bytes == 2 << 20


def test_the_least_size_is_exact() -> None:
    for max_nodes, chunk, block in ((8, 16 << 20, 2 << 20), (8, 1 << 20, 32 << 10),
                                    (4, 2 << 20, 64 << 10), (32, 256 << 10, 32 << 10)):
        least = min_region_bytes(max_nodes=max_nodes, chunk_bytes=chunk, block_bytes=block)
        kw = dict(max_nodes=max_nodes, chunk_bytes=chunk, block_bytes=block)
        assert chunk_area_bytes(size_bytes=least, **kw) >= chunk
        assert chunk_area_bytes(size_bytes=least - PAGE_BYTES, **kw) < chunk
    assert min_region_bytes(max_nodes=8, chunk_bytes=16 << 20, block_bytes=2 << 20) == 18 << 20


async def test_a_region_without_room_for_one_block_is_refused_at_create(region_path: str) -> None:
    least = min_region_bytes(max_nodes=8, chunk_bytes=16 << 20, block_bytes=BIG.block_bytes)
    c = cfg(region_path, 0, create=True, layout=BIG, region_bytes=16 << 20,
            chunk_bytes=16 << 20)
    with pytest.raises(E.RegionTooSmall, match=f"region_bytes={least} "):
        await tract.Engine.open(c)
    assert not os.path.exists(region_path)
    async with tract.Engine.open(cfg(region_path, 0, create=True, layout=BIG,
                                     region_bytes=least, chunk_bytes=16 << 20)) as eng:
        keys = eng.block_keys(range(BIG.block_tokens))
        kv = np.ones(BIG.kv_shape(1), dtype=np.float32)
        assert await eng.put_kv(keys, kv) == 1
        out = np.zeros_like(kv)
        assert np.array_equal(await eng.get_kv(keys, out=out), kv)


async def test_an_attached_region_without_room_for_one_block_is_refused(region_path: str
                                                                         ) -> None:
    """Regions made by other means (``tract region init``, an engine of smaller blocks)."""
    secs = region_sections(size_bytes=4 << 20, max_nodes=8, chunk_bytes=1 << 20)
    Region.create(region_path, 4 << 20, sections=secs, initialize=initialize).close()
    with pytest.raises(E.RegionTooSmall, match="chunks of 1048576 bytes cannot hold one "
                                               "2097152-byte block"):
        await tract.Engine.open(cfg(region_path, 0, layout=BIG, chunk_bytes=2 << 20))
    async with tract.Engine.open(cfg(region_path, 0)):      # TINY's 32 KiB blocks fit
        pass
    least = min_region_bytes(max_nodes=8, chunk_bytes=16 << 20, block_bytes=TINY.block_bytes)
    secs = region_sections(size_bytes=16 << 20, max_nodes=8, chunk_bytes=16 << 20)
    Region.create(region_path, 16 << 20, sections=secs, initialize=initialize,
                  overwrite=True).close()
    with pytest.raises(E.RegionTooSmall, match=f"hold no 16777216-byte chunk.*>= {least} "):
        await tract.Engine.open(cfg(region_path, 0))


def test_region_create_names_the_least_size(region_path: str) -> None:
    secs = [SectionSpec(name="big", nbytes=1 << 20)]
    least = min_size_bytes(secs, max_nodes=8, root_slots=64)
    with pytest.raises(E.RegionTooSmall, match=f"at least {least} bytes"):
        Region.create(region_path, 1 << 20, sections=secs)
    Region.create(region_path, least, sections=secs).close()
