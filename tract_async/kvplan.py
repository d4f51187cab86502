"""Tensor checks and copy plans between KV tensors and blocks in the region.

A put or get moves, for each block j and layer l, two contiguous runs: K then V, each
``half_layer_bytes`` long. In the tensor (all layers ``(L, 2, n*T, H, D)``, one layer
``(2, n*T, H, D)``) run (l, h, j) starts at element ``((l*2 + h) * n*T + j*T) * H*D``; in the
region at ``payload_offset_j + (l*2 + h) * half_layer_bytes`` (blocks are stored layer-major so
that one layer of a block is one contiguous range). A plan is an int64 array of rows
(region_offset, tensor_byte_offset, nbytes) that one jitted call executes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .config import KVLayout
from .errors import KeyMismatch, TensorMismatch
from .keys import KEY_BYTES


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Keys as a list of 32-byte values. Raises KeyMismatch."""
    if isinstance(keys, (bytes, bytearray)):
        raise KeyMismatch("keys must be a sequence of block keys, got a single bytes object")
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            raise KeyMismatch(f"keys[{i}] is not a {KEY_BYTES}-byte block key "
                              f"(got {type(k).__name__} of length {len(k) if hasattr(k, '__len__') else '?'})")
    return out


def check_tensor(t: torch.Tensor, layout: KVLayout, num_blocks: int, layer: int | None, *,
                 what: str, allow_cuda: bool = False) -> None:
    """Raise TensorMismatch unless ``t`` has the layout's dtype and the put/get shape."""
    if not isinstance(t, torch.Tensor):
        raise TensorMismatch(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    want = layout.kv_shape(num_blocks, layer)
    if tuple(t.shape) != want:
        form = "all layers (num_layers, 2, tokens, kv_heads, head_dim)" if layer is None else \
            "one layer (2, tokens, kv_heads, head_dim)"
        raise TensorMismatch(f"{what} has shape {tuple(t.shape)}, expected {want} for {num_blocks} "
                             f"blocks of {layout.block_tokens} tokens, {form}")
    if t.dtype != layout.dtype:
        raise TensorMismatch(f"{what} has dtype {t.dtype}, the layout says {layout.dtype}")
    if t.device.type != "cpu" and not (allow_cuda and t.device.type == "cuda"):
        raise TensorMismatch(f"{what} is on {t.device}; this path takes CPU tensors"
                             + ("" if allow_cuda else " (CUDA tensors need a CUDA build)"))


def check_layer(layer: int | None, layout: KVLayout) -> None:
    if layer is not None and (not isinstance(layer, int) or not 0 <= layer < layout.num_layers):
        raise TensorMismatch(f"layer must be in 0..{layout.num_layers - 1} or None, got {layer!r}")


def plan(layout: KVLayout, payload_offsets: np.ndarray, block_positions: np.ndarray,
         num_blocks_in_tensor: int, layer: int | None) -> np.ndarray:
    """Copy plan rows (region_offset, tensor_byte_offset, nbytes) for the given blocks.

    ``payload_offsets[i]`` is the region offset of the block at position ``block_positions[i]``
    of the tensor (which holds ``num_blocks_in_tensor`` blocks).
    """
    T, half = layout.block_tokens, layout.half_layer_bytes
    row_bytes = half // T                      # bytes of one token of one half (H*D*itemsize)
    nT = num_blocks_in_tensor * T
    layers = np.arange(layout.num_layers) if layer is None else np.array([layer])
    lh = (layers[:, None] * 2 + np.arange(2)[None, :]).reshape(-1)          # (l*2 + h)
    # tensor index of the (l, h) plane: all-layers tensors index planes by l*2+h; one-layer
    # tensors by h alone
    plane = lh if layer is None else lh - 2 * layer
    pos = np.asarray(block_positions, dtype=np.int64)
    poff = np.asarray(payload_offsets, dtype=np.int64)
    region_off = poff[:, None] + lh[None, :] * half
    tensor_off = (plane[None, :] * nT + pos[:, None] * T) * row_bytes
    rows = np.empty((pos.size * lh.size, 3), dtype=np.int64)
    rows[:, 0] = region_off.reshape(-1)
    rows[:, 1] = tensor_off.reshape(-1)
    rows[:, 2] = half
    return rows


def layer_mask(layout: KVLayout, layer: int | None) -> tuple[int, int]:
    """(lo, hi) bits of the layers a put covers; all layers for None."""
    if layer is None:
        n = layout.num_layers
        full = (1 << n) - 1
        return full & (2**64 - 1), full >> 64
    return ((1 << layer) & (2**64 - 1), (1 << layer) >> 64)
