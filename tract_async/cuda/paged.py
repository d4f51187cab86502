"""Paged KV pools (vLLM-style): checking them and turning block ids into row plans.

Supported pool forms (``T`` = block_tokens, ``H`` = kv_heads, ``D`` = head_dim, ``NB`` = pool
blocks; every tensor contiguous, the layout's dtype, on one CUDA device):

========================  ============================================  ==========================
form                      shape                                         note
========================  ============================================  ==========================
list, ``"2nb"``           L tensors ``(2, NB, T, H, D)``                vLLM FlashAttention layout
list, ``"nb2"``           L tensors ``(NB, 2, T, H, D)``                FlashInfer layout
stacked, ``"2nb"``        one tensor ``(L, 2, NB, T, H, D)``
stacked, ``"nb2"``        one tensor ``(L, NB, 2, T, H, D)``
one layer                 one tensor ``(2, NB, T, H, D)`` / ``(NB, 2, ...)``  only with ``layer=i``
========================  ============================================  ==========================

The form is inferred from the shapes; ``pool_layout`` ("2nb", default, or "nb2") says which of the
two per-layer orders is meant (they are ambiguous when NB == 2).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ..config import KVLayout
from ..errors import TensorMismatch
from . import tables

POOL_LAYOUTS = ("2nb", "nb2")


@dataclasses.dataclass(frozen=True)
class Pool:
    """A checked pool: the tensors (one or L), and how to address rows in them."""
    tensors: tuple[Any, ...]
    stacked: bool
    block_major: bool
    pool_blocks: int

    def plan(self, layout: KVLayout, payload_offsets: np.ndarray, block_ids: np.ndarray,
             layer: int | None) -> tables.RowPlan:
        return tables.paged_plan(layout, payload_offsets, block_ids, layer,
                                 pool_blocks=self.pool_blocks, stacked=self.stacked,
                                 pool_layers=len(self.tensors), block_major=self.block_major)


def check_pool(pool: Any, layout: KVLayout, layer: int | None, *,
               pool_layout: str = "2nb") -> Pool:
    """Check a pool against the layout; raises TensorMismatch naming what to change."""
    import torch
    if pool_layout not in POOL_LAYOUTS:
        raise TensorMismatch(f"pool_layout must be one of {POOL_LAYOUTS}, got {pool_layout!r}")
    bm = pool_layout == "nb2"
    tail = (layout.block_tokens, layout.kv_heads, layout.head_dim)
    if isinstance(pool, torch.Tensor):
        tensors: Sequence[Any] = (pool,)
    elif isinstance(pool, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in pool):
        tensors = tuple(pool)
    else:
        raise TensorMismatch(f"pool must be a tensor or a list of per-layer tensors, got "
                             f"{type(pool).__name__}")
    if not tensors:
        raise TensorMismatch("pool is an empty list")
    dev = tensors[0].device
    for i, t in enumerate(tensors):
        if t.dtype != layout.dtype:
            raise TensorMismatch(f"pool[{i}] has dtype {t.dtype}, the layout says {layout.dtype}")
        if t.device.type != "cuda" or t.device != dev:
            raise TensorMismatch(f"pool[{i}] is on {t.device}; paged transfers take CUDA pools, "
                                 f"all on one device ({dev})")
        if not t.is_contiguous():
            raise TensorMismatch(f"pool[{i}] is not contiguous")
    shape0 = tuple(tensors[0].shape)
    L = layout.num_layers
    per_layer = "(NB, 2, T, H, D)" if bm else "(2, NB, T, H, D)"
    if len(tensors) == 1 and len(shape0) == 6:
        lead = shape0[:3]
        nb = lead[1] if bm else lead[2]
        ok = lead[0] == L and (lead[2] == 2 if bm else lead[1] == 2) and shape0[3:] == tail
        if not ok:
            raise TensorMismatch(f"stacked pool has shape {shape0}; expected (L, {per_layer[1:]} "
                                 f"with L={L}, T,H,D={tail}")
        return Pool(tensors=tuple(tensors), stacked=True, block_major=bm, pool_blocks=nb)
    for i, t in enumerate(tensors):
        s = tuple(t.shape)
        if len(s) != 5 or s[2:] != tail or (s[1] != 2 if bm else s[0] != 2) \
                or s != shape0:
            raise TensorMismatch(f"pool[{i}] has shape {s}; expected per layer {per_layer} with "
                                 f"T,H,D={tail}, every layer the same")
    nb = shape0[0] if bm else shape0[1]
    if len(tensors) == 1:
        if layer is None and L != 1:
            raise TensorMismatch(f"a single per-layer pool {per_layer} needs layer=i; for all "
                                 f"layers pass a list of {L} pools or a stacked tensor")
    elif len(tensors) != L:
        raise TensorMismatch(f"pool has {len(tensors)} layers, the layout {L}")
    return Pool(tensors=tuple(tensors), stacked=False, block_major=bm, pool_blocks=nb)
