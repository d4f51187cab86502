"""Row plans: what a GPU <-> region transfer moves, as arrays the copy engines consume.

Every KV transfer moves rows of ``half_layer_bytes`` (K or V of one layer of one block): the
unit both sides agree on. A :class:`RowPlan` lists, in *region order* (block by block, and
within a block layer by layer, K then V), for each row: its region offset, which source tensor
holds it and at which row of that tensor's ``(rows, row_bytes)`` view. Because rows of one block
are adjacent in the region, plan order is also the order of a contiguous GPU staging buffer that
one DMA (or a few) can move, so a gather into staging turns scattered rows into few large copies.

Sources (sources for a put, destinations for a get):

* contiguous KV ``(L, 2, n*T, H, D)`` / ``(2, n*T, H, D)``: one tensor; ``kvplan.plan``'s tensor
  offsets are multiples of ``half_layer_bytes``, so the row is ``tensor_offset // row_bytes``;
* a paged pool: per layer ``(2, num_blocks, T, H, D)`` (vLLM's layout), either a list with one
  tensor per layer or one stacked tensor ``(L, 2, num_blocks, T, H, D)``; block id ``b`` of layer
  ``l``, half ``h`` is row ``h*num_blocks + b`` of tensor ``l`` (list) or row
  ``(l*2 + h)*num_blocks + b`` of the stacked tensor.

Pure numpy: no CUDA here, so all of it is tested on the CPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..config import KVLayout
from ..errors import TensorMismatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPlan:
    """Rows of ``row_bytes`` in region order: ``region_off[k]`` <-> row ``row[k]`` of source
    ``src[k]``."""
    region_off: np.ndarray      # int64 (K,)
    src: np.ndarray             # int64 (K,) index into the transfer's list of tensors
    row: np.ndarray             # int64 (K,) row in that tensor's (rows, row_bytes) view
    row_bytes: int

    def __len__(self) -> int:
        return int(self.region_off.shape[0])

    @property
    def nbytes(self) -> int:
        return len(self) * self.row_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Runs:
    """Maximal contiguous region ranges of a plan: run ``i`` is plan rows
    ``[first[i], first[i] + count[i])`` at region offset ``region_off[i]``."""
    region_off: np.ndarray      # int64 (R,)
    first: np.ndarray           # int64 (R,)
    count: np.ndarray           # int64 (R,)
    row_bytes: int

    def __len__(self) -> int:
        return int(self.region_off.shape[0])

    @property
    def nbytes(self) -> np.ndarray:
        return self.count * self.row_bytes

    def uniform_stride(self) -> tuple[int, int] | None:
        """``(stride_bytes, run_bytes)`` if every run has the same length and consecutive runs
        are the same distance apart (one 2-D copy moves them all), else None."""
        if len(self) == 0 or (self.count != self.count[0]).any():
            return None
        run_bytes = int(self.count[0]) * self.row_bytes
        if len(self) == 1:
            return run_bytes, run_bytes
        d = np.diff(self.region_off)
        if (d != d[0]).any() or d[0] < run_bytes:
            return None
        return int(d[0]), run_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Affine:
    """Plan rows as a strided view of one source: row ``k = j*P + p`` is source row
    ``base + j*block_stride + p*plane_stride`` (all in rows). A gather or scatter is then one
    strided copy, with no index tensor."""
    src: int
    base: int
    blocks: int                 # m
    planes: int                 # P
    block_stride: int
    plane_stride: int


def from_kvplan(plan: np.ndarray, row_bytes: int) -> RowPlan:
    """A RowPlan from ``kvplan.plan`` rows (region_offset, tensor_byte_offset, nbytes) of a
    contiguous tensor (source 0)."""
    plan = np.asarray(plan, dtype=np.int64)
    if plan.size and ((plan[:, 2] != row_bytes).any() or (plan[:, 1] % row_bytes).any()):
        raise AssertionError("kvplan rows are not whole half-layer rows: kvplan and "
                             "cuda.tables disagree on the layout")
    return RowPlan(region_off=plan[:, 0].copy(), src=np.zeros(plan.shape[0], dtype=np.int64),
                   row=plan[:, 1] // row_bytes, row_bytes=row_bytes)


def paged_plan(layout: KVLayout, payload_offsets: np.ndarray, block_ids: np.ndarray,
               layer: int | None, *, pool_blocks: int, stacked: bool,
               pool_layers: int, block_major: bool = False) -> RowPlan:
    """Rows for blocks ``block_ids`` (pool block ids, one per key) stored at
    ``payload_offsets`` (region), every layer or just ``layer``.

    ``stacked``: one tensor ``(L, 2, NB, T, H, D)``; else a list of ``pool_layers`` tensors
    ``(2, NB, T, H, D)`` (all layers, or one when ``layer`` is given and only that layer's pool
    is passed: ``pool_layers == 1``).
    """
    half = layout.half_layer_bytes
    ids = np.asarray(block_ids, dtype=np.int64)
    poff = np.asarray(payload_offsets, dtype=np.int64)
    layers = np.arange(layout.num_layers) if layer is None else np.array([layer])
    lh = (layers[:, None] * 2 + np.arange(2)[None, :]).reshape(-1)       # l*2 + h, region order
    h = lh % 2
    lyr = lh // 2
    region_off = poff[:, None] + lh[None, :] * half
    # row of (block b, half h) inside one layer's pool
    in_layer = (ids[:, None] * 2 + h[None, :]) if block_major else \
        (h[None, :] * pool_blocks + ids[:, None])
    if stacked:
        src = np.zeros_like(region_off)
        row = lyr[None, :] * (2 * pool_blocks) + in_layer
    else:
        # one tensor per layer; a single pool given with layer=i is tensor 0
        t = lyr if pool_layers == layout.num_layers else np.zeros_like(lyr)
        src = np.broadcast_to(t[None, :], region_off.shape).copy()
        row = in_layer
    return RowPlan(region_off=region_off.reshape(-1), src=src.reshape(-1),
                   row=row.reshape(-1).astype(np.int64), row_bytes=half)


def runs_of(plan: RowPlan) -> Runs:
    """Coalesce consecutive plan rows that are adjacent in the region."""
    k = len(plan)
    if k == 0:
        z = np.zeros(0, dtype=np.int64)
        return Runs(region_off=z, first=z, count=z, row_bytes=plan.row_bytes)
    brk = np.flatnonzero(np.diff(plan.region_off) != plan.row_bytes) + 1
    first = np.concatenate(([0], brk)).astype(np.int64)
    count = np.diff(np.concatenate((first, [k]))).astype(np.int64)
    return Runs(region_off=plan.region_off[first].copy(), first=first, count=count,
                row_bytes=plan.row_bytes)


def split_runs(runs: Runs, lo: int, hi: int) -> Runs:
    """The runs restricted to plan rows ``[lo, hi)`` (a run crossing a bound is cut)."""
    end = runs.first + runs.count
    keep = (end > lo) & (runs.first < hi)
    first = np.maximum(runs.first[keep], lo)
    last = np.minimum(end[keep], hi)
    shift = (first - runs.first[keep]) * runs.row_bytes
    return Runs(region_off=runs.region_off[keep] + shift, first=first, count=last - first,
                row_bytes=runs.row_bytes)


def affine_of(plan: RowPlan, planes: int) -> Affine | None:
    """Describe the plan as one strided view of one source if it is one (see :class:`Affine`),
    with ``planes`` rows per block (2 per layer moved)."""
    k = len(plan)
    if k == 0 or k % planes or (plan.src != plan.src[0]).any():
        return None
    m = k // planes
    r = plan.row.reshape(m, planes)
    base = int(r[0, 0])
    plane_stride = int(r[0, 1] - r[0, 0]) if planes > 1 else 0
    block_stride = int(r[1, 0] - r[0, 0]) if m > 1 else 0
    want = base + np.arange(m)[:, None] * block_stride + np.arange(planes)[None, :] * plane_stride
    if not np.array_equal(r, want) or block_stride < 0 or plane_stride < 0:
        return None
    return Affine(src=int(plan.src[0]), base=base, blocks=m, planes=planes,
                  block_stride=block_stride, plane_stride=plane_stride)


def pieces(num_blocks: int, planes: int, row_bytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """Split ``num_blocks`` blocks (``planes`` rows each) into consecutive block ranges of about
    ``piece_bytes``, so that the gather of one piece overlaps the DMA of the previous one."""
    per = max(1, piece_bytes // max(1, planes * row_bytes))
    return [(a, min(num_blocks, a + per)) for a in range(0, num_blocks, per)]


def check_block_ids(block_ids: object, n: int, pool_blocks: int) -> np.ndarray:
    """Block ids as int64, one per key, each in ``[0, pool_blocks)``, no repeats.
    Raises TensorMismatch."""
    try:
        ids = np.asarray(block_ids.tolist() if hasattr(block_ids, "tolist") else block_ids,
                         dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise TensorMismatch(f"block_ids must be a sequence of ints: {e}") from None
    if ids.size != n:
        raise TensorMismatch(f"{ids.size} block ids for {n} keys: give one pool block per key")
    if ids.size and (ids.min() < 0 or ids.max() >= pool_blocks):
        raise TensorMismatch(f"block ids must be in [0, {pool_blocks}) (the pool's num_blocks), "
                             f"got range [{ids.min()}, {ids.max()}]")
    if np.unique(ids).size != ids.size:
        raise TensorMismatch("block_ids repeat a pool block: each key needs its own block")
    return ids
