"""Every error hint names something that exists: the keyword, the config field, the CLI flag.

A hint that names an option that is not there (``EngineConfig(overwrite=True)`` when the field
did not exist, ``overwrite=True`` on the command line whose flag is ``--force``) sends a newcomer
in a circle; these tests read the option out of the message and look it up.
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch

import tract_async as tract
from tract_async import errors as E
from tract_async.cli import build_parser, main
from tract_async.region import Region
from tests.support.engine_util import cfg


def test_region_exists_names_the_create_keyword(region_path: str) -> None:
    Region.create(region_path, 1 << 22).close()
    with pytest.raises(E.RegionExists) as exc:
        Region.create(region_path, 1 << 22)
    assert "Region.create(..., overwrite=True)" in str(exc.value)
    assert "overwrite" in inspect.signature(Region.create).parameters


def test_cli_init_twice_names_force(region_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["region", "init", region_path, "--size", "4M"]) == 0
    capsys.readouterr()
    assert main(["region", "init", region_path, "--size", "4M"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tract: RegionExists:") and f"tract region init --force {region_path}" in err
    assert "overwrite=True" not in err          # not a thing on the command line
    args = build_parser().parse_args(["region", "init", region_path, "--force"])
    assert args.force
    assert main(["region", "init", region_path, "--size", "4M", "--force"]) == 0


def test_create_in_a_missing_directory_names_it(tmp_path) -> None:
    path = str(tmp_path / "no" / "such" / "region")
    with pytest.raises(E.RegionNotFound) as exc:
        Region.create(path, 1 << 22)
    assert f"directory {tmp_path / 'no'} does not exist" in str(exc.value)
    assert not os.path.exists(tmp_path / "no")


def test_create_under_proc_says_what_is_wrong() -> None:
    with pytest.raises(E.RegionError) as exc:
        Region.create(f"/proc/tract-test-{os.getpid()}", 1 << 22)
    msg = str(exc.value)
    assert "/proc" in msg and "proc file system" in msg and "/dev/shm" in msg


async def test_a_put_larger_than_the_region_says_so(region_path: str) -> None:
    """One node alone: the message gives the real limit and does not talk of other nodes."""
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=64,
                            dtype=torch.float16)
    async with tract.Engine.open(cfg(region_path, 0, create=True, layout=layout,
                                     region_bytes=8 << 20)) as eng:
        keys = eng.block_keys(range(16 * 4000))
        with pytest.raises(E.RegionFull) as exc:
            await eng.put_kv(keys, torch.zeros(layout.kv_shape(len(keys)), dtype=layout.dtype))
        msg = str(exc.value)
        assert "larger than the whole region" in msg and "other node" not in msg
        most = int(msg.split("holds at most ")[1].split()[0])
        assert 0 < most < 4000
        assert eng.lookup(keys) == 0                # all or nothing
        n = await eng.put_kv(keys[:most], torch.zeros(layout.kv_shape(most), dtype=layout.dtype))
        assert n == most                            # the limit it named is the real one


def test_re_create_hints_name_real_options(region_path: str) -> None:
    """A region whose creator died midway: the message says how to re-create it, by names
    that exist in the config, the library and the CLI."""
    import dataclasses
    from tract_async.region import layout as L
    Region.create(region_path, 1 << 22).close()
    with open(region_path, "r+b") as f:
        f.seek(L.INIT_STATE_OFFSET)
        f.write((0).to_bytes(8, "little"))
    with pytest.raises(E.RegionCorrupt) as exc:
        Region.attach(region_path, wait_init_s=0.0)
    msg = str(exc.value)
    assert "EngineConfig(create=True, overwrite=True)" in msg
    assert "overwrite" in {f.name for f in dataclasses.fields(tract.EngineConfig)}
    assert "`tract region init --force PATH`" in msg
    assert main(["region", "init", region_path, "--size", "4M", "--force"]) == 0
