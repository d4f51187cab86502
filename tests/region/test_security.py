"""Who may map a region (SECURITY.md): created 0600 unless asked otherwise, never world-writable;
attach refuses a file that another non-root user owns or that every user may write, with
RegionUntrusted saying what to change, and changes nothing."""
from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator

import pytest

import tract_async as tract
from tract_async import errors as E
from tract_async.region import Region
from tests.support.engine_util import TINY, cfg

FOREIGN_UID = 54321          # no such user needs to exist: only the file's owner field matters


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def umask_zero() -> Iterator[None]:
    """A permissive umask, so that a mode that comes out right was set, not masked."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_created_0600_whatever_the_umask(region_path: str, umask_zero: None) -> None:
    Region.create(region_path, 1 << 22, max_nodes=2).close()
    assert _mode(region_path) == 0o600


def test_group_mode_is_set_exactly(region_path: str) -> None:
    old = os.umask(0o077)                  # would mask 0660 down to 0600
    try:
        Region.create(region_path, 1 << 22, max_nodes=2, mode=0o660).close()
    finally:
        os.umask(old)
    assert _mode(region_path) == 0o660
    with Region.attach(region_path):       # our own group-shared file is trusted
        pass


def test_overwrite_resets_the_mode(region_path: str) -> None:
    Region.create(region_path, 1 << 22, max_nodes=2, mode=0o640).close()
    Region.create(region_path, 1 << 22, max_nodes=2, overwrite=True).close()
    assert _mode(region_path) == 0o600


@pytest.mark.parametrize("mode", [0o666, 0o602, 0o1000, -1])
def test_world_writable_or_bad_mode_is_refused(region_path: str, mode: int) -> None:
    with pytest.raises(ValueError, match="mode"):
        Region.create(region_path, 1 << 22, max_nodes=2, mode=mode)
    assert not os.path.exists(region_path)
    with pytest.raises(E.ConfigError, match="region_mode"):
        tract.EngineConfig(layout=TINY, region=region_path, create=True, region_mode=mode)


def test_attach_refuses_world_writable(region_path: str) -> None:
    Region.create(region_path, 1 << 22, max_nodes=2).close()
    os.chmod(region_path, 0o666)
    before = _digest(region_path)
    with pytest.raises(E.RegionUntrusted, match=r"writable by every user.*chmod o-w") as ei:
        Region.attach(region_path)
    assert isinstance(ei.value, E.RegionPermissionError)   # one family with "cannot open"
    with pytest.raises(E.RegionUntrusted):
        Region.attach(region_path, readonly=True)
    assert _digest(region_path) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_attach_refuses_another_users_file(region_path: str) -> None:
    Region.create(region_path, 1 << 22, max_nodes=2).close()
    os.chown(region_path, FOREIGN_UID, -1)
    before = _digest(region_path)
    with pytest.raises(E.RegionUntrusted, match=rf"owned by uid {FOREIGN_UID}.*trusted_uids"):
        Region.attach(region_path)
    with pytest.raises(E.RegionUntrusted):   # and overwrite does not truncate it either
        Region.create(region_path, 1 << 22, max_nodes=2, overwrite=True)
    assert _digest(region_path) == before
    with Region.attach(region_path, trusted_uids=[FOREIGN_UID]) as r:   # explicitly trusted
        assert r.max_nodes == 2


def test_create_does_not_follow_a_planted_symlink(region_path: str, tmp_path) -> None:  # noqa: ANN001
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, region_path)
    with pytest.raises(E.RegionUntrusted, match="symbolic link"):
        Region.create(region_path, 1 << 22, max_nodes=2, overwrite=True)
    with pytest.raises(E.RegionExists):
        Region.create(region_path, 1 << 22, max_nodes=2)
    assert victim.read_bytes() == b"precious"


async def test_engine_creates_with_region_mode(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, region_mode=0o640)):
        assert _mode(region_path) == 0o640
