"""Row plans of the CUDA path, checked on the CPU against the engine's real region layout.

The CPU engine's put (``kvplan`` + Numba copies) is the reference: whatever the CUDA path would
move for a contiguous tensor or a paged pool must be exactly the bytes the CPU path put at each
region offset.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tract_async as tract
from tract_async.stores import plan as kvplan
from tract_async.cuda import copy as ccopy
from tract_async.cuda import paged, tables
from tract_async.errors import TensorMismatch
from tract_async.keys import keys_to_words

LAYOUT = tract.KVLayout(num_layers=3, block_tokens=4, kv_heads=2, head_dim=8,
                        dtype=torch.float16)            # half-layer rows of 128 bytes


def region_rows(buf: np.ndarray, plan: tables.RowPlan) -> np.ndarray:
    """The plan's rows as region bytes (K, row_bytes)."""
    return np.stack([buf[o:o + plan.row_bytes] for o in plan.region_off.tolist()])


def tensor_rows(tensors, plan: tables.RowPlan) -> np.ndarray:
    """The plan's rows as source bytes, through ``copy.rows_view`` (what the Copier indexes)."""
    views = [ccopy.rows_view(t, plan.row_bytes).contiguous().view(torch.uint8).numpy()
             for t in tensors]
    return np.stack([views[s][r] for s, r in zip(plan.src.tolist(), plan.row.tolist())])


async def _put_cpu(region_path, kv, n, layer=None):
    cfg = tract.EngineConfig(region=region_path, region_bytes=32 << 20, create=True,
                             layout=LAYOUT, chunk_bytes=1 << 16)
    eng = await tract.Engine.open(cfg)
    keys = eng.block_keys(list(range(n * LAYOUT.block_tokens)))
    return eng, keys


@pytest.mark.parametrize("n", [1, 3, 5])
async def test_contiguous_plan_rows_are_the_bytes_the_cpu_path_stored(region_path, n):
    g = torch.Generator().manual_seed(n)
    kv = torch.randn(LAYOUT.kv_shape(n), generator=g).to(LAYOUT.dtype)
    eng, keys = await _put_cpu(region_path, kv, n)
    try:
        await eng.put_kv(keys, kv)
        snap = eng._store.index.snapshot(keys_to_words(keys))
        for layer in (None, 0, 2):
            plan = tables.from_kvplan(kvplan.plan(LAYOUT, snap[:, 3], np.arange(n), n, layer),
                                      LAYOUT.half_layer_bytes)
            src = kv if layer is None else kv[layer].contiguous()
            assert np.array_equal(tensor_rows([src], plan), region_rows(eng.region.buf, plan))
            # region order: within a block the rows are adjacent
            assert len(plan) == n * (2 * LAYOUT.num_layers if layer is None else 2)
    finally:
        await eng.close()


@pytest.mark.parametrize("form", ["list", "stacked", "list-nb2", "stacked-nb2"])
async def test_paged_plan_matches_the_contiguous_put(region_path, form):
    """Scatter a contiguous KV into pool blocks (by hand, with torch indexing), then the paged
    plan must point each region row at the pool row holding the same bytes."""
    n, nb = 4, 9
    ids = np.array([7, 0, 5, 2])
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(LAYOUT.kv_shape(n), generator=g).to(LAYOUT.dtype)
    T = LAYOUT.block_tokens
    nb2 = form.endswith("nb2")
    pools = []
    for layer in range(LAYOUT.num_layers):
        p = torch.zeros((2, nb, T, LAYOUT.kv_heads, LAYOUT.head_dim), dtype=LAYOUT.dtype)
        for j, b in enumerate(ids.tolist()):
            p[:, b] = kv[layer, :, j * T:(j + 1) * T]
        pools.append(p.transpose(0, 1).contiguous() if nb2 else p)
    pool = torch.stack(pools) if form.startswith("stacked") else pools
    eng, keys = await _put_cpu(region_path, kv, n)
    try:
        await eng.put_kv(keys, kv)
        poffs = eng._store.index.snapshot(keys_to_words(keys))[:, 3]
        p = paged.Pool(tensors=(pool,) if isinstance(pool, torch.Tensor) else tuple(pool),
                       stacked=form.startswith("stacked"), block_major=nb2, pool_blocks=nb)
        for layer in (None, 1):
            plan = p.plan(LAYOUT, poffs, ids, layer)
            assert np.array_equal(tensor_rows(p.tensors, plan),
                                  region_rows(eng.region.buf, plan))
        # a single layer's pool with layer=i addresses tensor 0
        one = paged.Pool(tensors=(pools[2],), stacked=False, block_major=nb2, pool_blocks=nb)
        plan = one.plan(LAYOUT, poffs, ids, 2)
        assert set(plan.src.tolist()) == {0}
        assert np.array_equal(tensor_rows(one.tensors, plan), region_rows(eng.region.buf, plan))
    finally:
        await eng.close()


def test_runs_coalesce_adjacent_rows_and_split_at_pieces():
    rb = 100
    off = np.array([0, 100, 200, 1000, 1100, 5000], dtype=np.int64)
    plan = tables.RowPlan(region_off=off, src=np.zeros(6, np.int64), row=np.arange(6), row_bytes=rb)
    r = tables.runs_of(plan)
    assert r.region_off.tolist() == [0, 1000, 5000]
    assert r.first.tolist() == [0, 3, 5] and r.count.tolist() == [3, 2, 1]
    assert r.uniform_stride() is None
    s = tables.split_runs(r, 1, 4)                      # rows 1..3: [100, 200] and [1000]
    assert s.region_off.tolist() == [100, 1000]
    assert s.first.tolist() == [1, 3] and s.count.tolist() == [2, 1]
    # one layer of blocks 2 MiB apart: one 2-D copy
    off = np.array([0, 64, 2048, 2048 + 64, 4096, 4096 + 64], dtype=np.int64)
    plan = tables.RowPlan(region_off=off, src=np.zeros(6, np.int64), row=np.arange(6), row_bytes=64)
    assert tables.runs_of(plan).uniform_stride() == (2048, 128)
    assert tables.runs_of(plan)  # non-empty


def test_affine_detection_and_identity():
    n = 5
    plan = tables.from_kvplan(kvplan.plan(LAYOUT, np.arange(n) * LAYOUT.block_bytes, np.arange(n),
                                          n, None), LAYOUT.half_layer_bytes)
    a = tables.affine_of(plan, 2 * LAYOUT.num_layers)
    assert (a.base, a.blocks, a.planes, a.block_stride, a.plane_stride) == (0, n, 6, 1, n)
    # a subset of positions (blocks already present are skipped): still affine if consecutive
    plan = tables.from_kvplan(kvplan.plan(LAYOUT, np.arange(2) * LAYOUT.block_bytes,
                                          np.array([2, 3]), n, 1), LAYOUT.half_layer_bytes)
    a = tables.affine_of(plan, 2)
    assert (a.base, a.blocks, a.planes, a.block_stride, a.plane_stride) == (2, 2, 2, 1, n)
    plan = tables.from_kvplan(kvplan.plan(LAYOUT, np.arange(2) * LAYOUT.block_bytes,
                                          np.array([0, 3]), n, 1), LAYOUT.half_layer_bytes)
    a = tables.affine_of(plan, 2)
    assert a.block_stride == 3
    # random pool ids: not affine; two sources: not affine
    rp = tables.paged_plan(LAYOUT, np.arange(3) * 4096, np.array([4, 1, 7]), 0, pool_blocks=8,
                           stacked=False, pool_layers=1)
    assert tables.affine_of(rp, 2) is None
    rp = tables.paged_plan(LAYOUT, np.arange(3) * 4096, np.array([1, 2, 3]), None, pool_blocks=8,
                           stacked=False, pool_layers=3)
    assert tables.affine_of(rp, 6) is None


def test_affine_view_gathers_plan_order_rows():
    """The Copier's strided view (no index tensor) yields exactly the plan's rows, in order."""
    n = 4
    kv = torch.arange(int(np.prod(LAYOUT.kv_shape(n))), dtype=torch.int32).to(LAYOUT.dtype)
    kv = kv.reshape(LAYOUT.kv_shape(n))
    for positions in (np.arange(n), np.array([1, 2, 3])):
        plan = tables.from_kvplan(kvplan.plan(LAYOUT, np.arange(positions.size) * 4096, positions,
                                              n, None), LAYOUT.half_layer_bytes)
        aff = tables.affine_of(plan, 6)
        views = [ccopy.rows_view(kv, plan.row_bytes)]
        got = ccopy.Copier._affine_view(None, views, aff).reshape(len(plan), -1)
        want = torch.stack([views[0][r] for r in plan.row.tolist()])
        assert torch.equal(got, want)


def test_index_parts_split_rows_by_source():
    rp = tables.paged_plan(LAYOUT, np.arange(2) * 4096, np.array([3, 1]), None, pool_blocks=4,
                           stacked=False, pool_layers=3)
    parts = ccopy.Copier._index_parts(None, rp, 0, len(rp))
    assert [t for t, _, _ in parts] == [0, 1, 2]
    for t, pos, rows in parts:
        assert (rp.src[pos] == t).all() and np.array_equal(rp.row[pos], rows)
    assert sorted(np.concatenate([p for _, p, _ in parts]).tolist()) == list(range(len(rp)))


def test_zerocopy_table_is_relative_to_the_anchors_in_16_byte_units():
    a = torch.zeros(4096, dtype=torch.uint8)
    b = torch.zeros(4096, dtype=torch.uint8)
    views = [ccopy.rows_view(a, 128), ccopy.rows_view(b, 128)]
    plan = tables.RowPlan(region_off=np.array([0, 256, 4096]), src=np.array([0, 1, 1]),
                          row=np.array([2, 0, 5]), row_bytes=128)
    tbl = ccopy.Copier._zerocopy_table(None, plan, views, device_to_region=True)
    base = a.data_ptr()
    for k in range(3):
        addr = views[plan.src[k]].data_ptr() + plan.row[k] * 128
        assert tbl[k, 0] * 16 == addr - base
        assert tbl[k, 1] * 16 == plan.region_off[k]
    back = ccopy.Copier._zerocopy_table(None, plan, views, device_to_region=False)
    assert np.array_equal(back[:, ::-1], tbl)


def test_choose_prefers_dma_for_large_runs_and_2d_for_strided_layers():
    def runs(count, run_rows, stride_rows, rb=65536 // 2):
        off = np.repeat(np.arange(count) * stride_rows * rb, run_rows) + \
            np.tile(np.arange(run_rows) * rb, count)
        return tables.runs_of(tables.RowPlan(region_off=off, src=np.zeros(off.size, np.int64),
                                             row=np.arange(off.size), row_bytes=rb))
    big = runs(1, 64, 64)                                     # one 2 MiB run
    layer = runs(256, 2, 64)                                  # 64 KiB every 2 MiB
    assert ccopy.choose("auto", big, 32768, have_2d=True, have_triton=True) == "dma"
    assert ccopy.choose("auto", layer, 32768, have_2d=True, have_triton=True) == "dma2d"
    assert ccopy.choose("auto", layer, 32768, have_2d=False, have_triton=True) == "zerocopy"
    assert ccopy.choose("auto", layer, 32768, have_2d=False, have_triton=False) == "dma"
    assert ccopy.choose("zerocopy", big, 32768, have_2d=True, have_triton=True) == "zerocopy"


def test_pieces_cover_every_block_once():
    ps = tables.pieces(10, 4, 1000, 9000)             # 2 blocks (8000 B) per piece
    assert ps == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert tables.pieces(3, 64, 1 << 15, 1 << 30) == [(0, 3)]


def test_block_ids_and_pool_checks_reject_bad_input():
    with pytest.raises(TensorMismatch, match="one pool block per key"):
        tables.check_block_ids([1, 2], 3, 8)
    with pytest.raises(TensorMismatch, match=r"\[0, 8\)"):
        tables.check_block_ids([1, 2, 8], 3, 8)
    with pytest.raises(TensorMismatch, match="repeat"):
        tables.check_block_ids([1, 1, 2], 3, 8)
    assert tables.check_block_ids(torch.tensor([3, 1]), 2, 8).tolist() == [3, 1]
    cpu_pool = torch.zeros((2, 8, 4, 2, 8), dtype=torch.float16)
    with pytest.raises(TensorMismatch, match="CUDA"):
        paged.check_pool([cpu_pool] * 3, LAYOUT, None)
    with pytest.raises(TensorMismatch, match="dtype"):
        paged.check_pool([cpu_pool.float()] * 3, LAYOUT, None)
    with pytest.raises(TensorMismatch, match="pool_layout"):
        paged.check_pool([cpu_pool] * 3, LAYOUT, None, pool_layout="hnd")
