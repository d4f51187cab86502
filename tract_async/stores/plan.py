"""Tensor checks and copy plans between KV tensors and blocks in the region.

A put or get moves, for each block j and layer l, two contiguous runs: K then V, each
``half_layer_bytes`` long. In the tensor (all layers ``(L, 2, n*T, H, D)``, one layer
``(2, n*T, H, D)``) run (l, h, j) starts at element ``((l*2 + h) * n*T + j*T) * H*D``; in the
region at ``payload_offset_j + (l*2 + h) * half_layer_bytes`` (blocks are stored layer-major so
that one layer of a block is one contiguous range). A plan is an int64 array of rows
(region_offset, tensor_byte_offset, nbytes) that one jitted call executes.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import numpy as np

from .. import arrays
from ..config import KVLayout
from ..errors import KeyMismatch, TensorMismatch
from ..keys import KEY_BYTES, BlockKey


_KEY_TYPES = {bytes, bytearray, BlockKey}


_LAST_CHECKED: tuple[Any, list[bytes]] = (None, [])
"""The caller's last key list and the checked copy ``check_keys`` returned for it."""

CACHE_MIN_KEYS = 1
"""Key lists at least this long are remembered: every size, since a one-block layer-streamed
request passes its list 64 times too (~2 µs a check on the 2-core VM against ~0.1 for the
identity and list comparison)."""


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Keys as a list of 32-byte values. Raises KeyMismatch.

    A layer-streamed transfer passes the same key list for every layer (32 times a request):
    when ``keys`` is the list checked last and still holds the same keys (one list comparison,
    identity first: ~5 ns a key), the copy made then is returned again instead of checking
    every key (~40 µs for 1024 keys on the 2-core VM); the lifecycle then also finds its batch
    by identity (``BlockLifecycle.filling``)."""
    last, copy = _LAST_CHECKED
    if keys is last and keys == copy:
        return copy
    if isinstance(keys, (bytes, bytearray)):
        raise KeyMismatch("keys must be a sequence of block keys, got a single bytes object")
    out = list(keys)
    try:                              # the common case checked by C loops (~70 vs ~250 ns a key)
        types = set(map(type, out))
        if types <= _KEY_TYPES and set(map(len, out)) <= {KEY_BYTES}:
            if bytearray not in types:      # immutable keys only: a cached check stays true
                _remember(keys, out)
            return out
    except TypeError:                 # something without a len(): the loop below names it
        pass
    for i, k in enumerate(out):
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            raise KeyMismatch(f"keys[{i}] is not a {KEY_BYTES}-byte block key "
                              f"(got {type(k).__name__} of length {len(k) if hasattr(k, '__len__') else '?'})")
    return out


def _remember(keys: Sequence[bytes], out: list[bytes]) -> None:
    global _LAST_CHECKED
    if len(out) >= CACHE_MIN_KEYS and type(keys) is list:
        _LAST_CHECKED = (keys, out)     # one assignment: another thread sees a whole pair


def check_tensor(t: object, layout: KVLayout, num_blocks: int, layer: int | None, *,
                 what: str, allow_cuda: bool = False) -> None:
    """Raise TensorMismatch unless ``t`` (a torch tensor or a numpy array) has the layout's
    dtype and the put/get shape."""
    torch = sys.modules.get("torch")
    if (torch is not None and type(t) is torch.Tensor and (t.is_cpu or allow_cuda and t.is_cuda)
            and t.dtype is getattr(torch, layout.dtype_name)
            and t.shape == layout.kv_shape(num_blocks, layer)):
        # the common case in four attribute reads (the checks below make ~10 calls into torch:
        # ~1.5 µs hot, ~4.7 µs on the first put after the loop woke, on the 2-core VM)
        return
    if not arrays.is_array(t):
        raise TensorMismatch(f"{what} must be a torch.Tensor or a numpy array, got "
                             f"{type(t).__name__}")
    want = layout.kv_shape(num_blocks, layer)
    if tuple(t.shape) != want:
        form = "all layers (num_layers, 2, tokens, kv_heads, head_dim)" if layer is None else \
            "one layer (2, tokens, kv_heads, head_dim)"
        raise TensorMismatch(f"{what} has shape {tuple(t.shape)}, expected {want} for {num_blocks} "
                             f"blocks of {layout.block_tokens} tokens, {form}"
                             + _partial_hint(t, layout, num_blocks, layer))
    if not arrays.array_dtype_ok(t, layout.dtype_name):
        store = "" if arrays.is_tensor(t) else \
            f" (as numpy: {arrays.NUMPY_STORAGE[layout.dtype_name]}, which holds its bits)"
        raise TensorMismatch(f"{what} has dtype {arrays.array_dtype_str(t)}, the layout says "
                             f"{layout.dtype_name}{store}")
    dev = arrays.device_type(t)
    if dev != "cpu" and not (allow_cuda and dev == "cuda"):
        raise TensorMismatch(f"{what} is on {t.device}; this path takes CPU tensors"  # type: ignore[attr-defined]
                             + ("" if allow_cuda else " (CUDA tensors need a CUDA build)"))


def _partial_hint(t: Any, layout: KVLayout, num_blocks: int, layer: int | None) -> str:
    """Why a tensor of the right form has tokens the keys do not cover, when that is the
    mismatch: keys exist for full blocks only (``KeyScheme.chain``), so a prompt shorter than a
    block has none, and a longer one's trailing partial block has none."""
    want = layout.kv_shape(num_blocks, layer)
    shape = tuple(t.shape)
    axis = 2 if layer is None else 1
    if len(shape) != len(want) or shape[:axis] + shape[axis + 1:] != want[:axis] + want[axis + 1:]:
        return ""
    tokens, bt = shape[axis], layout.block_tokens
    if num_blocks == 0 and 0 < tokens < bt:
        return (f": no keys, because a prompt shorter than one block of {bt} tokens ({tokens} "
                f"here) has no block key (block_keys keys full blocks only); there is nothing to "
                f"store or read for it: skip the call, or use a smaller block_tokens")
    if tokens // bt == num_blocks and tokens % bt:
        full = f"{num_blocks} full block" + ("s" if num_blocks != 1 else "")
        return (f": {tokens} tokens are {full} and {tokens % bt} more, which have no key "
                f"(block_keys keys full blocks only); pass the first {num_blocks * bt} tokens")
    return ""


def check_layer(layer: int | None, layout: KVLayout) -> None:
    if layer is not None and (not isinstance(layer, int) or not 0 <= layer < layout.num_layers):
        raise TensorMismatch(f"layer must be in 0..{layout.num_layers - 1} or None, got {layer!r}")


@functools.lru_cache(maxsize=1024)
def plan_template(layout: KVLayout, layer: int | None, num_blocks_in_tensor: int
                   ) -> tuple[np.ndarray, int]:
    """The rows of one block at payload offset 0 and tensor block position 0 (read-only), and
    the tensor-offset step per block position.

    Why: a block's rows differ from this template only by its payload offset (column 0) and
    its tensor position (column 1); building them from ``np.arange`` and broadcasts on every
    call cost ~7 µs, much of a small put's Python time. The template depends on the layout, the
    layer and the tensor's block count only (a bounded cache: a few entries per layout in
    practice)."""
    T, half = layout.block_tokens, layout.half_layer_bytes
    row_bytes = half // T                      # bytes of one token of one half (H*D*itemsize)
    nT = num_blocks_in_tensor * T
    layers = np.arange(layout.num_layers) if layer is None else np.array([layer])
    lh = (layers[:, None] * 2 + np.arange(2)[None, :]).reshape(-1)          # (l*2 + h)
    # tensor index of the (l, h) plane: all-layers tensors index planes by l*2+h; one-layer
    # tensors by h alone
    plane = lh if layer is None else lh - 2 * layer
    rows = np.empty((lh.size, 3), dtype=np.int64)
    rows[:, 0] = lh * half
    rows[:, 1] = plane * nT * row_bytes
    rows[:, 2] = half
    rows.setflags(write=False)
    return rows, T * row_bytes


def template(layout: KVLayout, num_blocks_in_tensor: int) -> np.ndarray:
    """The rows of one whole block at payload offset 0 and tensor position 0 (read-only) in a
    tensor of every layer holding ``num_blocks_in_tensor`` blocks: what the fused kernels
    (``stores/fused.py``) shift per block, by its payload offset and ``block_step``."""
    return plan_template(layout, None, num_blocks_in_tensor)[0]


def block_step(layout: KVLayout) -> int:
    """Tensor bytes between two consecutive blocks within one (layer, K/V) plane."""
    return layout.block_tokens * (layout.half_layer_bytes // layout.block_tokens)


@functools.lru_cache(maxsize=64)
def _arange(n: int) -> np.ndarray:
    a = np.arange(n, dtype=np.int64)
    a.setflags(write=False)
    return a


def positions(todo: Sequence[int], num_keys: int) -> np.ndarray:
    """``todo`` (ascending positions, from ``BlockLifecycle.reserve``, or a ``range`` of every
    position) as an int64 array, read-only; every position is a cached ``arange`` (a 4096-block
    put's list took ~0.2 ms to convert), without looking at ``todo`` beyond its length."""
    if len(todo) == num_keys:
        return _arange(num_keys)
    return np.array(todo, dtype=np.int64)


def plan(layout: KVLayout, payload_offsets: np.ndarray, block_positions: np.ndarray,
         num_blocks_in_tensor: int, layer: int | None) -> np.ndarray:
    """Copy plan rows (region_offset, tensor_byte_offset, nbytes) for the given blocks.

    ``payload_offsets[i]`` is the region offset of the block at position ``block_positions[i]``
    of the tensor (which holds ``num_blocks_in_tensor`` blocks). Rows are block-major: block
    i's rows are ``i*R .. i*R+R-1`` (R = 2 per layer covered), in (layer, K/V) order.
    """
    tmpl, pos_step = plan_template(layout, layer, num_blocks_in_tensor)
    pos = np.asarray(block_positions, dtype=np.int64).reshape(-1)
    poff = np.asarray(payload_offsets, dtype=np.int64).reshape(-1)
    if pos.size == 1:        # the small-put path: one add of a 3-vector to the template
        return tmpl + np.array([int(poff[0]), int(pos[0]) * pos_step, 0], dtype=np.int64)
    rows = np.empty((pos.size, tmpl.shape[0], 3), dtype=np.int64)
    rows[:] = tmpl
    rows[:, :, 0] += poff[:, None]
    rows[:, :, 1] += (pos * pos_step)[:, None]
    return rows.reshape(-1, 3)


def layer_mask(layout: KVLayout, layer: int | None) -> tuple[int, int]:
    """(lo, hi) bits of the layers a put covers; all layers for None."""
    if layer is None:
        n = layout.num_layers
        full = (1 << n) - 1
        return full & (2**64 - 1), full >> 64
    return ((1 << layer) & (2**64 - 1), (1 << layer) >> 64)
