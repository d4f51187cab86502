"""The CPU-checkable halves of the GPU path: the direct 2-D copies' arithmetic against the
plan the CPU copies use, the host's record of CPU-cached payload (``region/cpumarks.py``) with
its incoherent-backend negative control, and the early layer publish from another thread
(``BlockLifecycle.publish_early``) while the event loop is blocked.

No CUDA here: what needs a device is in ``test_cuda_gpu.py``.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest

import tract_async as tract
import tract_kernels as K
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys, np_out
from tract_async.cuda import direct
from tract_async.cuda.store import invalidate_for_dma
from tract_async.keys import keys_to_words
from tract_async.region import cpumarks
from tract_async.region import index as ix
from tract_async.region.region import remove as remove_region
from tract_async.stores import plan as kvplan

LLAMA = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128,
                       dtype="bfloat16")


# -- direct copies: the same bytes as the plan ------------------------------------------------

def _pairs_of_copies(rows: np.ndarray, half: int) -> np.ndarray:
    """Every (region offset, tensor offset) row of ``half`` bytes the 2-D copies move (a copy
    wider than ``half`` moves consecutive such rows on both sides)."""
    out = []
    for reg, rpitch, ten, tpitch, width, height in rows.tolist():
        assert width % half == 0
        for r in range(height):
            for w in range(0, width, half):
                out.append((reg + r * rpitch + w, ten + r * tpitch + w))
    return np.array(sorted(out), dtype=np.int64).reshape(-1, 2)


def _pairs_of_plan(lay: tract.KVLayout, poffs: np.ndarray, layer: int | None) -> np.ndarray:
    n = len(poffs)
    p = kvplan.plan(lay, poffs, np.arange(n, dtype=np.int64), n, layer)
    assert (p[:, 2] == lay.half_layer_bytes).all()
    return np.array(sorted(map(tuple, p[:, :2].tolist())), dtype=np.int64).reshape(-1, 2)


def _offsets(kind: str, n: int, lay: tract.KVLayout, rng: np.random.Generator) -> np.ndarray:
    bb = lay.block_bytes
    base = 1 << 30
    if kind == "evenly":
        return base + np.arange(n, dtype=np.int64) * bb
    if kind == "wider":                           # slots larger than a block
        return base + np.arange(n, dtype=np.int64) * (bb + 4096)
    if kind == "two-chunks":
        return np.concatenate([base + np.arange(n // 2) * bb,
                               (base << 1) + np.arange(n - n // 2) * bb]).astype(np.int64)
    if kind == "descending":
        return base + np.arange(n, dtype=np.int64)[::-1].copy() * bb
    slots = rng.choice(4 * n, size=n, replace=False)    # scattered: a prefix cache's blocks
    return (base + slots * bb).astype(np.int64)


@pytest.mark.parametrize("kind", ["evenly", "wider", "two-chunks", "descending", "scattered"])
@pytest.mark.parametrize("n", [1, 2, 7, 33])
@pytest.mark.parametrize("layer", [None, 0, 5, 31])
def test_direct_copies_move_exactly_the_plans_rows(kind: str, n: int, layer: int | None) -> None:
    rng = np.random.default_rng(n * 100 + (layer or 0))
    poffs = _offsets(kind, n, LLAMA, rng)
    dc = direct.plan(LLAMA, poffs, layer, tensor_ptr=0, region_ptr=0)
    planes = 2 if layer is not None else 2 * LLAMA.num_layers
    segs = direct.segments(poffs, LLAMA.layer_bytes if layer is not None else LLAMA.block_bytes)
    if dc is None:
        assert segs.shape[0] * planes > direct.MAX_CALLS
        return
    assert dc.nbytes == n * planes * LLAMA.half_layer_bytes
    assert len(dc) == (1 if n == 1 else segs.shape[0] * planes)   # one block: one copy
    assert np.array_equal(_pairs_of_copies(dc.rows, dc.half), _pairs_of_plan(LLAMA, poffs, layer))
    # a 2-D copy's pitch is at least its width (rows never overlap)
    assert (dc.rows[:, 1] >= dc.rows[:, 4]).all() and (dc.rows[:, 3] >= dc.rows[:, 4]).all()


@pytest.mark.parametrize("kind", ["evenly", "wider", "two-chunks", "descending", "scattered"])
@pytest.mark.parametrize("n", [2, 7, 33, 213])
def test_whole_blocks_one_copy_each_move_exactly_the_plans_rows(kind: str, n: int) -> None:
    """``TRACT_CUDA_WHOLE=blocks``: a whole-block transfer is one 2-D copy per block, its
    planes contiguous in the region, whatever the blocks' placement (no gather path)."""
    rng = np.random.default_rng(n)
    poffs = _offsets(kind, n, LLAMA, rng)
    dc = direct.plan(LLAMA, poffs, None, tensor_ptr=0, region_ptr=0, whole_pattern="blocks")
    assert dc is not None and len(dc) == n
    assert dc.nbytes == n * LLAMA.block_bytes
    assert np.array_equal(_pairs_of_copies(dc.rows, dc.half), _pairs_of_plan(LLAMA, poffs, None))
    rows = dc.rows
    assert (rows[:, 1] == LLAMA.half_layer_bytes).all()       # contiguous on the region side
    assert (rows[:, 5] == 2 * LLAMA.num_layers).all()
    # the same bytes at a tensor address and a region base, through the template cache
    cache = direct.TemplateCache(LLAMA, 1 << 40, whole_pattern="blocks")
    at = cache.plan(poffs, None, 1 << 20)
    assert np.array_equal(at.rows[:, [0, 2]], rows[:, [0, 2]] + [1 << 40, 1 << 20])
    # a layer's transfer keeps the planes pattern (two copies for evenly spaced blocks)
    if kind == "evenly":
        assert len(direct.plan(LLAMA, poffs, 3, tensor_ptr=0, region_ptr=0,
                               whole_pattern="blocks")) == 2


def test_the_whole_pattern_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(direct.WHOLE_ENV, raising=False)
    assert direct.whole_mode() == "planes"
    monkeypatch.setenv(direct.WHOLE_ENV, "blocks")
    assert direct.whole_mode() == "blocks"
    monkeypatch.setenv(direct.WHOLE_ENV, "rows")
    with pytest.raises(ValueError, match="TRACT_CUDA_WHOLE"):
        direct.whole_mode()


def test_evenly_spaced_blocks_take_two_copies_a_layer() -> None:
    poffs = (1 << 30) + np.arange(213, dtype=np.int64) * LLAMA.block_bytes
    assert len(direct.plan(LLAMA, poffs, 7, tensor_ptr=0, region_ptr=0)) == 2
    assert len(direct.plan(LLAMA, poffs, None, tensor_ptr=0, region_ptr=0)) == 64


def test_scattered_whole_blocks_keep_the_gather_path() -> None:
    poffs = ((1 << 30) + np.arange(64, dtype=np.int64)[::-1] * 3 * LLAMA.block_bytes).copy()
    poffs[::2] += LLAMA.block_bytes          # no two neighbours evenly spaced with the next
    assert direct.plan(LLAMA, np.random.default_rng(0).permutation(poffs), None,
                       tensor_ptr=0, region_ptr=0) is None


def test_scattered_layer_blocks_go_to_the_zero_copy_kernel_past_its_limit() -> None:
    """Where the zero-copy kernel can take a plan, a layer's copies stop at
    ``ZEROCOPY_MAX_CALLS`` (9 runs: 18 copies -> the gather path, which picks the kernel);
    eight runs and fewer stay 2-D copies; whole blocks keep ``MAX_CALLS``."""
    bb = LLAMA.block_bytes
    def runs(k: int) -> np.ndarray:        # descending offsets: one block a run
        return np.arange(k, dtype=np.int64)[::-1].copy() * 3 * bb
    lim = direct.ZEROCOPY_MAX_CALLS
    assert len(direct.plan(LLAMA, runs(lim // 2), 3, 0, 0, max_calls=lim)) == lim
    assert direct.plan(LLAMA, runs(lim // 2 + 1), 3, 0, 0, max_calls=lim) is None
    assert direct.plan(LLAMA, runs(lim // 2 + 1), 3, 0, 0) is not None      # no kernel: 2-D
    two = np.concatenate([np.arange(4) * bb, (1 << 30) + np.arange(4) * bb]).astype(np.int64)
    assert len(direct.plan(LLAMA, two, None, 0, 0, max_calls=lim)) == 2 * 2 * LLAMA.num_layers
    cache = direct.TemplateCache(LLAMA, region_ptr=0, max_calls=lim)
    assert cache.plan(runs(lim // 2 + 1), 3, 0) is None


def test_a_stride_past_the_widest_pitch_splits_the_run() -> None:
    poffs = np.array([0, direct.MAX_PITCH + LLAMA.block_bytes], dtype=np.int64)
    assert direct.segments(poffs, LLAMA.layer_bytes).shape[0] == 2


@pytest.mark.parametrize("mode", ["auto", "all"])
@pytest.mark.parametrize("kind", ["evenly", "two-chunks", "descending", "scattered"])
@pytest.mark.parametrize("n", [1, 2, 7, 33, 213])
@pytest.mark.parametrize("layer", [None, 0, 31])
def test_batched_copies_move_exactly_the_plans_rows(mode: str, kind: str, n: int,
                                                    layer: int | None) -> None:
    """Where batched copies are available, a plan of many runs goes as one batch of 1-D copies
    (``auto``: more than ``BATCH_MIN_CALLS`` 2-D copies; ``all``: any plan of several blocks),
    one per block and plane, moving exactly the CPU plan's rows; others keep the 2-D copies
    (or the gather path), as without batches."""
    rng = np.random.default_rng(n * 100 + (layer or 0) + 7)
    poffs = _offsets(kind, n, LLAMA, rng)
    planes = 2 if layer is not None else 2 * LLAMA.num_layers
    segs = direct.segments(poffs, LLAMA.layer_bytes if layer is not None else LLAMA.block_bytes)
    dc = direct.plan(LLAMA, poffs, layer, tensor_ptr=1 << 36, region_ptr=1 << 40, batch=mode)
    want_batch = (n > 1 and n * planes <= direct.BATCH_MAX_COPIES
                  and (mode == "all" or segs.shape[0] * planes > direct.BATCH_MIN_CALLS))
    if dc is None:
        assert not want_batch and segs.shape[0] * planes > direct.MAX_CALLS
        return
    assert (dc.batch is not None) == want_batch
    plain = direct.plan(LLAMA, poffs, layer, tensor_ptr=1 << 36, region_ptr=1 << 40)
    if not want_batch:
        assert plain is not None and dc.calls == plain.calls
        return
    assert len(dc) == 1 and dc.calls == []                  # one driver call
    reg, ten, sizes = dc.batch
    assert reg.dtype == ten.dtype == np.int64 and sizes.dtype == np.uint64
    assert reg.shape == ten.shape == sizes.shape == (n * planes,)
    assert (sizes == LLAMA.half_layer_bytes).all() and dc.nbytes == int(sizes.sum())
    pairs = _pairs_of_copies(dc.rows - np.array([1 << 40, 0, 1 << 36, 0, 0, 0]), dc.half)
    assert np.array_equal(pairs, _pairs_of_plan(LLAMA, poffs, layer))


def test_the_template_cache_batches_every_layer_alike() -> None:
    """A batched template shifted to each layer and tensor address equals a fresh batched plan
    (the region addresses move by the layer, the tensor's by its address)."""
    poffs = _offsets("scattered", 213, LLAMA, np.random.default_rng(3))
    cache = direct.TemplateCache(LLAMA, region_ptr=1 << 40, batch="auto")
    for layer in (0, 5, 31):
        for ptr in (0, (1 << 34) + 4096):
            got = cache.plan(poffs.copy(), layer, ptr)
            want = direct.plan(LLAMA, poffs, layer, tensor_ptr=ptr, region_ptr=1 << 40,
                               batch="auto")
            assert got.batch is not None and want.batch is not None
            for a, b in zip(got.batch, want.batch):
                assert np.array_equal(a, b)
    assert cache.misses == 1


def test_the_batch_policy_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(direct.BATCH_ENV, raising=False)
    assert direct.batch_mode() == "off"     # batches lost to every other way on the H100
    for m in direct.BATCH_MODES:
        monkeypatch.setenv(direct.BATCH_ENV, m)
        assert direct.batch_mode() == m
    monkeypatch.setenv(direct.BATCH_ENV, "sometimes")
    with pytest.raises(ValueError, match="TRACT_CUDA_BATCH"):
        direct.batch_mode()


def test_no_batch_without_the_runtime_call() -> None:
    class NoBatch:
        memcpy_batch = None
    assert "13.0" in direct.batch_probe(NoBatch(), "cuda", None)
    assert "13.0" in direct.batch_probe(None, "cuda", None)


def test_the_batch_attributes_have_cudas_layout() -> None:
    """``struct cudaMemcpyAttributes`` of CUDA 13.0: an enum, two (enum, int) locations and
    an unsigned int, 24 bytes; the one attribute set reads sources in stream order."""
    import ctypes
    assert ctypes.sizeof(direct._MemcpyAttributes) == 24
    assert direct._MemcpyAttributes.flags.offset == 20
    assert direct._ATTRS.srcAccessOrder == direct.SRC_ACCESS_ORDER_STREAM == 1
    assert direct._ATTR_IDX[0] == 0


def _direct_rows(dc: "direct.DirectCopy | None") -> list | None:
    return None if dc is None else dc.calls


@pytest.mark.parametrize("kind", ["evenly", "two-chunks", "scattered"])
def test_the_template_cache_gives_exactly_the_plan_of_every_layer(kind: str) -> None:
    """A request's later layers take its first layer's copies shifted (``direct.Template``):
    for every layer and tensor address the cached copies equal a fresh plan's, found by
    identity (a put's batch array) and by value (a get's fresh snapshot), and a plan that
    needs the gather path stays None."""
    rng = np.random.default_rng(7)
    poffs = _offsets(kind, 213 if kind != "scattered" else 300, LLAMA, rng)
    cache = direct.TemplateCache(LLAMA, region_ptr=1 << 40)
    for layer in (0, 1, 17, 31, None):
        for ptr in (0, 1 << 33, (1 << 34) + 4096):
            want = direct.plan(LLAMA, poffs, layer, tensor_ptr=ptr, region_ptr=1 << 40)
            got = cache.plan(poffs, layer, ptr)                    # same array: identity
            again = cache.plan(poffs.copy(), layer, ptr)           # a snapshot: by value
            assert _direct_rows(got) == _direct_rows(want) == _direct_rows(again)
            if want is not None:
                assert got.nbytes == want.nbytes and got.half == want.half
    assert cache.misses == 2, "one plan per (offsets, layer-or-whole), the rest from cache"
    other = poffs.copy()
    other[-1] += LLAMA.block_bytes * 1000          # one block elsewhere: another plan
    want = direct.plan(LLAMA, other, 3, tensor_ptr=0, region_ptr=1 << 40)
    assert _direct_rows(cache.plan(other, 3, 0)) == _direct_rows(want)
    assert cache.misses == 3


def test_the_template_cache_keeps_the_last_few_requests() -> None:
    cache = direct.TemplateCache(LLAMA, region_ptr=0, size=2)
    reqs = [(1 << 30) + (k << 28) + np.arange(16, dtype=np.int64) * LLAMA.block_bytes
            for k in range(3)]
    for p in reqs:
        cache.plan(p, 0, 0)
    assert cache.misses == 3
    cache.plan(reqs[2].copy(), 1, 0)
    cache.plan(reqs[1], 1, 0)
    assert cache.misses == 3
    cache.plan(reqs[0], 1, 0)                    # the oldest was dropped
    assert cache.misses == 4


# -- the host's record of CPU-cached payload --------------------------------------------------

def test_marks_granules_needing_and_clearing(tmp_path) -> None:
    path = str(tmp_path / "r.cpumarks")
    g = cpumarks.GRANULE_BYTES
    cm = cpumarks.CpuMarks(path, 64 * g)
    assert cm.marks.all(), "a new record must assume every granule may be cached"
    cm.marks[:] = 0
    poffs = np.array([0, 8 * g, 32 * g], dtype=np.int64)
    assert cm.needing(poffs, 0, 4 * g).size == 0
    cm.mark(poffs[1:2], 0, 4 * g)                          # granules 8..11
    assert cm.needing(poffs, 0, 4 * g).tolist() == [8 * g]
    assert cm.needing(poffs, 2 * g, g).tolist() == [8 * g]  # a layer inside the block
    assert cm.needing(poffs, 4 * g, g).size == 0            # a layer past what was read
    # a clear covers whole granules only: one that reaches past the range stays marked
    cm.clear(poffs[1:2], g // 2, g)
    assert cm.marks[8] == 1 and cm.marks[9] == 1
    cm.clear(poffs[1:2], g, 2 * g)
    assert cm.marks[8:12].tolist() == [1, 0, 0, 1]
    # another process of the host maps the same record
    other = cpumarks.CpuMarks(path, 64 * g)
    assert other.marks[8:12].tolist() == [1, 0, 0, 1]
    other.mark(np.array([40 * g], dtype=np.int64), 0, 1)
    assert cm.marks[40] == 1
    cm.close()
    other.close()


def test_needing_finds_a_single_mark_at_every_place_of_every_range(tmp_path) -> None:
    """``needing`` looks at eight granules a word in the middle of a range: one mark anywhere
    in a range, at any alignment of its ends (and in the record's last, partial word), must be
    found, and one just outside it must not."""
    g = cpumarks.GRANULE_BYTES
    cm = cpumarks.CpuMarks(str(tmp_path / "r.cpumarks"), 75 * g)   # 75 granules: 9 words + 3
    n = cm.marks.shape[0]
    for lo in range(0, 24):
        for ln in (1, 2, 7, 8, 9, 16, 17, 33, n - lo):
            hi = min(n, lo + ln)                # granules [lo, hi)
            p = np.array([lo * g], dtype=np.int64)
            for m in sorted({lo - 1, lo, (lo + hi) // 2, hi - 1, hi} & set(range(n))):
                cm.marks[:] = 0
                cm.marks[m] = 1
                got = cm.needing(p, 0, (hi - lo) * g).tolist()
                assert got == ([lo * g] if lo <= m < hi else []), (lo, hi, m)
    cm.close()


def test_sidecar_lives_beside_a_shm_region_and_goes_with_it(region_path) -> None:
    assert cpumarks.sidecar_path(region_path, "ab") == region_path + ".cpumarks"
    assert cpumarks.sidecar_path("/mnt/huge/r", "ab").endswith("tract-cpumarks-ab")

    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
            keys = eng.block_keys(list(range(16 * 3)))
            await eng.put_kv(keys, kv_for_keys(keys))
            await eng.get_kv(keys, out=np_out(keys))
            assert os.path.exists(region_path + ".cpumarks")
    asyncio.run(main())
    remove_region(region_path)
    assert not os.path.exists(region_path + ".cpumarks")


@pytest.mark.parametrize("n", [1, 16])
def test_every_cpu_read_marks_what_it_read(region_path, n: int) -> None:
    """The fused small get and the step-by-step get both mark (both count in ``count_read``);
    a put does not (non-temporal stores leave no cached line)."""
    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
            b = eng._store.blocks
            marks = b.cpu_marks
            marks.marks[:] = 0
            keys = eng.block_keys(list(range(16 * n)))
            await eng.put_kv(keys, kv_for_keys(keys))
            snap = b.index.snapshot(keys_to_words(keys))
            poffs = snap[:, 3].copy()
            assert marks.needing(poffs, 0, TINY.block_bytes).size == 0
            got = await eng.get_kv(keys, out=np_out(keys))
            assert all(block_matches(keys, got))
            assert sorted(marks.needing(poffs, 0, TINY.block_bytes).tolist()) == sorted(poffs.tolist())
    asyncio.run(main())


def _dma_read(m: K.Mem, off: int, nbytes: int) -> np.ndarray:
    """What a device's DMA reads on this host: memory, except where this host's cache holds
    the line (the read is snooped) -- the sim backend's read through its cache model, without
    the CPU read's invalidation."""
    out = np.zeros(nbytes, dtype=np.uint8)
    K.read_bytes(K.with_skip_site(m, ix.S_IX_PAYLOAD_READ), off, out.ctypes.data, nbytes,
                 ix.S_IX_PAYLOAD_READ)
    return out


async def _cpu_read_on_sim(eng, n: int, layer: int | None = None):
    """On a sim-backend engine with early evictions off (a cached line stays): put ``n`` blocks,
    forget every mark, read them (or ``layer``) with the CPU. Returns the lifecycle, the marks,
    the keys and their payload offsets."""
    b = eng._store.blocks
    K.mem_state(b.mem).ctl[1] = 0
    marks = b.cpu_marks
    keys = eng.block_keys(list(range(16 * n)))
    await eng.put_kv(keys, kv_for_keys(keys))
    marks.marks[:] = 0
    got = await eng.get_kv(keys, layer=layer, out=np_out(keys, layer=layer))
    assert all(block_matches(keys, got, layer=layer))
    poffs = b.index.snapshot(keys_to_words(keys))[:, 3].copy()
    return b, marks, keys, poffs


@pytest.mark.parametrize("tracked", [True, False])
def test_a_dma_after_a_cpu_read_sees_another_hosts_rewrite_only_with_the_marks(
        region_path, tracked: bool) -> None:
    """Incoherent backend: this node's CPU reads a block (its lines stay cached), another host
    rewrites the payload behind it, then a device reads it here. ``invalidate_for_dma`` drops
    the lines the CPU read left: the DMA sees the new bytes. Negative control (``tracked``
    False: the record forgets the CPU read): the DMA reads the stale cached lines."""
    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as eng:
            b, marks, keys, poffs = await _cpu_read_on_sim(eng, 2)   # the CPU read: lines cached
            span = TINY.block_bytes
            # another host writes new bytes into the first block's payload (straight to memory)
            other = K.make_mem(eng._region.buf, "sim", seed=99, evict_prob=0.0)
            # (the engine's CPU copy may run on copy threads with their own Mems: read where
            # the node's own Mem reads, its loop's, as the DMA model below does)
            new = np.full(span, 0x5A, dtype=np.uint8)
            K.write_bytes(other, int(poffs[0]), new.ctypes.data, span, ix.S_IX_PAYLOAD_READ)
            if not tracked:
                marks.marks[:] = 0
            dropped = await invalidate_for_dma(b, poffs[:1], None)
            seen = _dma_read(b.mem, int(poffs[0]), span)
            if tracked:
                assert dropped == 1
                assert np.array_equal(seen, new)
            else:
                assert dropped == 0
                assert not np.array_equal(seen, new), "the stale line should have been read"
            assert marks.needing(poffs[:1], 0, span).size == 0      # cleared by the drop
    asyncio.run(main())


def test_a_cpu_layer_read_marks_that_layer_only(region_path) -> None:
    """Incoherent backend: a CPU read of layer 1 caches that layer's lines and marks its pages,
    nothing else. Another host then rewrites layer 1 and layer 2 of a block: a DMA of layer 1
    invalidates it first and sees the new bytes; a DMA of layer 2 invalidates nothing and sees
    the new bytes too (the CPU never cached them). Whole-block marks for a layer read made every
    later DMA of the block's other layers invalidate them (and cost 154 µs of a 213-block layer
    get on the VM, ``stores/reading.py`` ``count_read``)."""
    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as eng:
            b, marks, keys, poffs = await _cpu_read_on_sim(eng, 3, layer=1)
            lb = TINY.layer_bytes
            assert np.array_equal(np.sort(marks.needing(poffs, lb, lb)), np.sort(poffs))
            for other_layer in range(TINY.num_layers):
                if other_layer != 1:
                    assert marks.needing(poffs, other_layer * lb, lb).size == 0, other_layer
            other = K.make_mem(eng._region.buf, "sim", seed=7, evict_prob=0.0)
            for layer, fill in ((1, 0x3C), (2, 0x4D)):
                new = np.full(lb, fill, dtype=np.uint8)
                K.write_bytes(other, int(poffs[0]) + layer * lb, new.ctypes.data, lb,
                              ix.S_IX_PAYLOAD_READ)
                dropped = await invalidate_for_dma(b, poffs[:1], layer)
                assert dropped == (1 if layer == 1 else 0), layer
                assert np.array_equal(_dma_read(b.mem, int(poffs[0]) + layer * lb, lb), new), layer
    asyncio.run(main())


def test_a_gpu_only_block_is_read_without_invalidation(region_path) -> None:
    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as eng:
            b = eng._store.blocks
            keys = eng.block_keys(list(range(16 * 4)))
            await eng.put_kv(keys, kv_for_keys(keys))
            poffs = b.index.snapshot(keys_to_words(keys))[:, 3].copy()
            first = await invalidate_for_dma(b, poffs, 2)        # a new record: all marked
            assert first == 4
            assert await invalidate_for_dma(b, poffs, 2) == 0    # nothing read since
            assert await invalidate_for_dma(b, poffs, 3) == 4    # another layer: once too
            assert await invalidate_for_dma(b, poffs, 3) == 0
    asyncio.run(main())


def test_the_sweeper_clears_and_invalidates_every_marked_granule(region_path) -> None:
    """Hardware backend: a fresh record has every granule marked; the sweeper (what a GPU node
    starts with its CUDA path) walks it once in its thread and leaves none marked, counting
    the ones it found; a GPU read after it invalidates nothing."""
    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
            b = eng._store.blocks
            keys = eng.block_keys(list(range(16 * 4)))
            await eng.put_kv(keys, kv_for_keys(keys))
            marks = b.cpu_marks
            marks.marks[::3] = 0                   # some granules unmarked already
            before = int(np.count_nonzero(marks.marks))
            assert before > 0
            sw = cpumarks.Sweeper(marks, b.mem, ix.S_IX_PAYLOAD_READ)
            assert sw.done.wait(30)
            sw.stop()
            assert sw.swept == before
            assert not marks.marks.any()
            poffs = b.index.snapshot(keys_to_words(keys))[:, 3].copy()
            assert await invalidate_for_dma(b, poffs, 1) == 0
    asyncio.run(main())


def test_the_sweeper_stops_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop`` returns with the thread gone (the engine calls it before the region is
    unmapped), also in the middle of a walk: the first step is held until ``stop`` has been
    called, and no step runs after it (a record of 16 steps over a private mapping)."""
    import mmap
    import tempfile
    mm = mmap.mmap(-1, 16 * cpumarks.SWEEP_GRANULES * cpumarks.GRANULE_BYTES)
    buf = np.frombuffer(mm, dtype=np.uint8)
    m = K.make_mem(buf, "hw")
    real, steps = cpumarks._sweep, []
    in_step, go_on = threading.Event(), threading.Event()

    def held_step(*args):             # the first step waits until stop() was called
        steps.append(args[2])
        if len(steps) == 1:
            in_step.set()
            assert go_on.wait(30)
        return real(*args)
    monkeypatch.setattr(cpumarks, "_sweep", held_step)
    with tempfile.TemporaryDirectory() as d:
        marks = cpumarks.CpuMarks(os.path.join(d, "r.cpumarks"), buf.size)
        sw = cpumarks.Sweeper(marks, m, ix.S_IX_PAYLOAD_READ)
        assert in_step.wait(30)
        stopper = threading.Thread(target=sw.stop)
        stopper.start()
        while not sw._stop.is_set():
            time.sleep(0.001)
        go_on.set()
        stopper.join(30)
        assert not stopper.is_alive() and not sw._thread.is_alive() and sw.done.is_set()
        assert steps == [0]
        assert sw.swept == cpumarks.SWEEP_GRANULES       # the one step, all marked
        assert marks.marks[cpumarks.SWEEP_GRANULES:].all()
        marks.close()
    del buf


@pytest.mark.parametrize("skip", [False, True])
def test_a_dma_after_a_sweep_sees_another_hosts_rewrite(region_path, skip: bool) -> None:
    """Incoherent backend: the sweep step is a GPU read's own (clear the mark, then drop the
    lines), done ahead. This node's CPU reads a block (lines cached, granules marked), another
    host rewrites it, the sweep runs over the whole record (on the loop's thread: the sim's
    cache model is per thread), and a device read then sees the new bytes without invalidating
    anything itself. Negative control (``skip``: the sweep's invalidation removed): the marks
    are gone all the same and the device reads the stale cached lines."""
    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as eng:
            b, marks, keys, poffs = await _cpu_read_on_sim(eng, 2)
            span = TINY.block_bytes
            other = K.make_mem(eng._region.buf, "sim", seed=5, evict_prob=0.0)
            new = np.full(span, 0x6B, dtype=np.uint8)
            K.write_bytes(other, int(poffs[0]), new.ctypes.data, span, ix.S_IX_PAYLOAD_READ)
            m = K.with_skip_site(b.mem, ix.S_IX_PAYLOAD_READ) if skip else b.mem
            total = marks.marks.shape[0]
            scratch = np.empty(total, dtype=np.int64)
            swept = cpumarks._sweep(marks.marks, m, 0, total, cpumarks.GRANULE_SHIFT,
                                    ix.S_IX_PAYLOAD_READ, scratch)
            assert swept > 0 and not marks.marks.any()
            assert await invalidate_for_dma(b, poffs[:1], None) == 0
            seen = _dma_read(b.mem, int(poffs[0]), span)
            if skip:
                assert not np.array_equal(seen, new), "the stale line should have been read"
            else:
                assert np.array_equal(seen, new)
    asyncio.run(main())


# -- the layer bits from another thread ---------------------------------------------------------

def _layers_of(eng: tract.Engine, keys: list[bytes]) -> list[int]:
    snap = eng._store.blocks.index.snapshot(keys_to_words(keys))
    return [int(x) for x in snap[:, 5]]


@pytest.mark.parametrize("backend", ["hw", "sim"])
def test_early_publish_from_another_thread_while_the_loop_is_blocked(region_path,
                                                                     backend: str) -> None:
    """A batch's layer is published by a thread while the loop's thread sleeps (as a prefill
    thread blocked in a CUDA synchronize): another node sees the layer before the loop runs
    again; the loop's bookkeeping afterwards (``region_done``) and the rest of the layers make
    the blocks READY and exact."""
    n = 12                                           # a FillBatch (more than SMALL_READ)

    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as prod, \
                tract.Engine.open(cfg(region_path, 1, backend=backend)) as cons:
            b = prod._store.blocks
            keys = prod.block_keys(list(range(16 * n)))
            kv = kv_for_keys(keys)
            await prod.put_kv(keys, kv[0].contiguous(), layer=0)
            res = b.filling(keys)
            assert res is not None and type(res).__name__ == "FillBatch"
            # the bytes of layer 1, copied as the CPU path copies them, not yet published
            poffs = b.payload_offsets(res)
            plan = kvplan.plan(TINY, poffs, kvplan.positions(list(range(n)), n), n, 1)
            k1 = kv[1].contiguous()
            await prod._store.copy_in(plan, k1.data_ptr(), plan.shape[0] * TINY.half_layer_bytes)
            done = threading.Event()
            t = threading.Thread(target=lambda: (b.publish_early(res, 1), done.set()))
            t.start()
            time.sleep(0.2)                          # the loop's thread is blocked here
            assert done.is_set()
            assert all(x & 0b11 == 0b11 for x in _layers_of(cons, keys))
            t.join()
            assert b.publish(keys, range(n), res, 1, 0, region_done=True) == n
            for i in (2, 3):
                await prod.put_kv(keys, kv[i].contiguous(), layer=i)
            got = await cons.get_kv(keys, out=np_out(keys), timeout=1.0)
            assert all(block_matches(keys, got))
            assert b.stats.early_publishes == 1
            assert not b.book.reserved
    asyncio.run(main())


def test_early_publish_after_an_abandon_stores_nothing(region_path) -> None:
    """An abandon splits the batch first (under the publish lock): an early publish that comes
    later stores no bit into entries that are being evicted."""
    n = 12

    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod:
            b = prod._store.blocks
            keys = prod.block_keys(list(range(16 * n)))
            kv = kv_for_keys(keys)
            await prod.put_kv(keys, kv[0].contiguous(), layer=0)
            res = b.filling(keys)
            await b.abandon(keys)
            assert b.publish_early(res, 1) is False
            assert prod.lookup(keys) == 0
            assert all(x == -1 for x in b.index.snapshot(keys_to_words(keys))[:, 0].tolist())
    asyncio.run(main())


# -- snapshots and revalidations split over threads ---------------------------------------------

def test_split_snapshot_and_revalidation_equal_the_single_threads(
        region_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PrefixIndex.meta_threads`` > 1 (hosts of 8+ CPUs): the same rows (a split snapshot;
    its threshold lowered here, so that a few hundred keys split) and the same verdicts
    (revalidation, one thread at any size) as one thread, absent and evicted keys included."""
    monkeypatch.setattr(ix, "PARALLEL_META_MIN", 256)
    n = ix.PARALLEL_META_MIN + 45

    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True,
                                         region_bytes=64 << 20)) as eng:
            b = eng._store.blocks
            keys = eng.block_keys(list(range(16 * n)))
            await eng.put_kv(keys[:n - 7], kv_for_keys(keys[:n - 7]))  # the last 7 absent
            words = keys_to_words(keys)
            b.index.meta_threads = 1
            one = b.index.snapshot(words)
            b.index.meta_threads = 3
            split = b.index.snapshot(words)
            assert np.array_equal(one, split)
            assert (split[n - 7:, 0] == -1).all() and (split[:n - 7, 0] >= 0).all()
            live = split[:n - 7]
            # evict a few, then revalidate both ways
            victims = [3, 100, n - 10]
            await b.evict([keys[i] for i in victims])
            res = []
            for t in (1, 3):
                b.index.meta_threads = t
                ok = np.ones(n - 7, dtype=np.bool_)
                bad = b.index.revalidate(live[:, 0], live[:, 1], live[:, 3], words[:n - 7], ok)
                res.append((bad, ok.copy()))
            assert res[0][0] == res[1][0] == len(victims)
            assert np.array_equal(res[0][1], res[1][1])
            assert sorted(np.flatnonzero(~res[1][1]).tolist()) == victims
    asyncio.run(main())


def test_a_requests_blocks_get_ascending_payload_offsets_after_frees(region_path) -> None:
    """Free lists give slots back in the order they were freed (reversed after a consumer read
    a request); a batch's slots are paired with its keys in ascending order, so a layer of the
    next request is one run of evenly spaced offsets: two 2-D copies, not one per block."""
    async def main() -> None:
        async with tract.Engine.open(cfg(region_path, 0, create=True, mode="transfer",
                                         region_bytes=64 << 20)) as eng:
            b = eng._store.blocks
            n = 24
            for r in range(4):
                keys = eng.block_keys(list(range(16 * n)), extra_keys=[f"r{r}"])
                for layer in range(TINY.num_layers):
                    await eng.put_kv(keys, kv_for_keys(keys, layer=layer), layer=layer)
                poffs = b.index.snapshot(keys_to_words(keys))[:, 3]
                assert (np.diff(poffs) > 0).all(), poffs
                segs = direct.segments(poffs, TINY.layer_bytes)
                assert segs.shape[0] <= 3, segs        # at most a chunk boundary or two
                got = await eng.get_kv(keys, out=np_out(keys))      # consumes: frees them
                assert all(block_matches(keys, got))
    asyncio.run(main())
