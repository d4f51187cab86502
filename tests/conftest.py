"""Shared fixtures: unique region paths that are always removed, both memory backends."""
from __future__ import annotations

import glob
import os
import uuid

import pytest


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run bench/gpu_suite.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def region_path() -> str:
    """A fresh /dev/shm path; the file (and any sibling with its prefix) is removed afterwards."""
    path = f"/dev/shm/tract-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield path
    for p in glob.glob(path + "*"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


@pytest.fixture(params=["hw", "sim"])
def backend(request: pytest.FixtureRequest) -> str:
    """Both memory backends: real instructions, and the incoherent-cache model."""
    return request.param


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Only this session's files (the pid is in the name): other pytest sessions may be running.
    leftovers = glob.glob(f"/dev/shm/tract-test-{os.getpid()}-*")
    for p in leftovers:  # a crashed child may have kept one alive; never leave them behind
        try:
            os.unlink(p)
        except OSError:
            pass
