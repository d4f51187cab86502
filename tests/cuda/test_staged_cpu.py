"""Staged whole-block CUDA transfers without a GPU: the stages ``routing.cuda_stages`` picks and
the copies ``direct.stage_copies`` makes of each (together exactly the unstaged transfer's). The
staged transfers on a device: ``tests/cuda/test_staged_gpu.py``."""
from __future__ import annotations

import numpy as np
import pytest

import tract_async as tract
from tract_async.cuda import direct
from tract_async.stores import routing as R

LLAMA = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128,
                       dtype="bfloat16")


def test_stages_grow_cover_every_block_once_and_only_whole_large_transfers_stage() -> None:
    assert R.cuda_stages(LLAMA, 213, None) == [(0, 16), (16, 64), (64, 213)]
    assert R.cuda_stages(LLAMA, 213, 3) is None                 # a layer: never staged
    assert R.cuda_stages(LLAMA, 63, None) is None               # under CUDA_STAGE_MIN_BYTES
    for n in (64, 65, 100, 213, 640, 1024, 5000):
        st = R.cuda_stages(LLAMA, n, None)
        assert st is not None and st[0] == (0, 16) and st[-1][1] == n
        assert all(a < z for a, z in st)
        assert all(st[i][1] == st[i + 1][0] for i in range(len(st) - 1))
        sizes = [z - a for a, z in st]
        assert sizes == sorted(sizes), sizes                    # none smaller than the one before


def test_stages_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(R.CUDA_STAGES_ENV, "0")
    assert R.cuda_stages(LLAMA, 213, None) is None


def _rows(dc: direct.DirectCopy) -> set[tuple[int, int, int]]:
    """Every row a DirectCopy moves: (region address, tensor address, width)."""
    out = set()
    for r, rp, t, tp, w, h in dc.calls:
        for i in range(h):
            out.add((r + i * rp, t + i * tp, w))
    return out


@pytest.mark.parametrize("scatter", [False, True])
def test_the_stages_copies_are_the_whole_transfers(scatter: bool) -> None:
    n = 213
    rng = np.random.default_rng(7)
    base = np.arange(n, dtype=np.int64) * LLAMA.block_bytes + (64 << 20)
    if scatter:                          # a few runs, as a reused region hands them out
        cut = sorted(rng.choice(np.arange(1, n), 3, replace=False))
        for c in cut:
            base[c:] += 5 * LLAMA.block_bytes
    region_ptr, tensor_ptr = 1 << 40, 1 << 36
    whole = direct.plan(LLAMA, base, None, tensor_ptr, region_ptr)
    assert whole is not None
    staged: set[tuple[int, int, int]] = set()
    total = 0
    for a, z in R.cuda_stages(LLAMA, n, None):
        dc = direct.stage_copies(LLAMA, base[a:z], n, a, region_ptr, tensor_ptr)
        assert dc is not None
        rows = _rows(dc)
        assert not rows & staged
        staged |= rows
        total += dc.nbytes
    assert staged == _rows(whole)
    assert total == whole.nbytes == n * LLAMA.block_bytes


def test_a_stage_of_too_many_runs_takes_the_gather_path() -> None:
    n = 16
    poffs = np.arange(n, dtype=np.int64)[::-1].copy() * LLAMA.block_bytes   # no two in a run
    assert direct.stage_copies(LLAMA, poffs, 64, 0, 0, 0) is None           # 16 x 64 > 256
