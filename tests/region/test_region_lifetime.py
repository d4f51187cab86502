"""Region lifetime under the Engine: a created region outlives its engine unless told otherwise.

``overwrite=True`` replaces a region left at the path, ``remove_on_close=True`` removes it when
the creating engine closes (not while other nodes are live on it), and the RegionExists hint
names those fields, which exist.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

import tract_async as tract
from tract_async import errors as E
from tests.support.engine_util import cfg, kv_for_keys


async def _store_one_block(path: str, **kw) -> tuple[str, list[bytes]]:
    async with tract.Engine.open(cfg(path, 0, create=True, **kw)) as eng:
        keys = eng.block_keys(range(16))
        await eng.put_kv(keys, kv_for_keys(keys))
        return str(eng.region.uuid), keys


async def test_a_created_region_outlives_its_engine_and_the_hint_names_real_fields(
        region_path: str) -> None:
    await _store_one_block(region_path)
    assert os.path.exists(region_path)                  # the default: it stays
    with pytest.raises(E.RegionExists) as exc:          # the script's second run
        await _store_one_block(region_path)
    msg = str(exc.value)
    fields = {f.name for f in dataclasses.fields(tract.EngineConfig)}
    for named in ("overwrite", "remove_on_close", "create"):
        assert f"{named}=True" in msg or f"{named}=False" in msg
        assert named in fields
    assert f"tract region rm {region_path}" in msg


async def test_overwrite_replaces_the_region(region_path: str) -> None:
    first, keys = await _store_one_block(region_path)
    async with tract.Engine.open(cfg(region_path, 0, create=True, overwrite=True)) as eng:
        assert str(eng.region.uuid) != first
        assert eng.lookup(keys) == 0                    # the old blocks went with the old region
    assert os.path.exists(region_path)


async def test_remove_on_close_lets_a_script_run_twice(region_path: str) -> None:
    for _ in range(2):
        await _store_one_block(region_path, remove_on_close=True)
        assert not os.path.exists(region_path)


async def test_remove_on_close_keeps_a_region_others_are_live_on(region_path: str) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True, remove_on_close=True))
    b = await tract.Engine.open(cfg(region_path, 1))
    try:
        with pytest.raises(E.RegionInUse, match=r"nodes \[1\] are still live"):
            await a.close()
        assert os.path.exists(region_path)
        keys = b.block_keys(range(16))
        await b.put_kv(keys, kv_for_keys(keys))          # b is not disturbed
        assert b.lookup(keys) == 1
    finally:
        await b.close()
        await a.close()                                  # idempotent


def test_lifetime_options_need_create(region_path: str) -> None:
    for name in ("overwrite", "remove_on_close"):
        with pytest.raises(E.ConfigError, match=f"{name}=True needs create=True"):
            cfg(region_path, 1, **{name: True})
