"""Copy plans (``kvplan.plan``) against the formula in kvplan's docstring, row by row: the
template cache and the 1-block fast path must build exactly the rows the formula gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tract_async as tract
from tract_async.stores import plan as kvplan

LAYOUTS = [tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=4, head_dim=64),
           tract.KVLayout(num_layers=70, block_tokens=8, kv_heads=2, head_dim=32,
                          dtype=torch.float32)]


def formula_rows(layout: tract.KVLayout, poffs: list[int], positions: list[int], n: int,
                 layer: int | None) -> list[tuple[int, int, int]]:
    """Run (l, h) of block j: tensor element ((plane * n*T + j*T) * H*D), region offset
    poff_j + (l*2 + h) * half, block-major then (layer, K/V) order."""
    T, half = layout.block_tokens, layout.half_layer_bytes
    row = half // T
    layers = range(layout.num_layers) if layer is None else [layer]
    out = []
    for poff, j in zip(poffs, positions):
        for li in layers:
            for h in range(2):
                plane = li * 2 + h if layer is None else h
                out.append((poff + (li * 2 + h) * half, (plane * n * T + j * T) * row, half))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=["64k", "70l"])
@pytest.mark.parametrize("layer", [None, 0, 3])
@pytest.mark.parametrize("n,take", [(1, [0]), (2, [1]), (5, [4, 0, 2]), (64, list(range(64)))])
def test_plan_rows_follow_the_formula(layout: tract.KVLayout, layer: int | None, n: int,
                                      take: list[int]) -> None:
    rng = np.random.default_rng(n)
    poffs = [int(x) * 64 for x in rng.integers(0, 1 << 24, len(take))]
    want = formula_rows(layout, poffs, take, n, layer)
    for args in ((np.array(poffs), np.array(take)), (poffs, take)):
        got = kvplan.plan(layout, args[0], args[1], n, layer)
        assert got.dtype == np.int64 and got.flags.c_contiguous and got.flags.writeable
        assert [tuple(r) for r in got.tolist()] == want
    # the cached template is never handed out (a caller may write its plan)
    again = kvplan.plan(layout, np.array(poffs), np.array(take), n, layer)
    again[:] = -1
    assert [tuple(r) for r in kvplan.plan(layout, poffs, take, n, layer).tolist()] == want
