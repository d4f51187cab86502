"""vLLM's paged KV layout <-> the engine's layer tensors (torch only, no vLLM import).

vLLM (0.34) hands a connector one view per attention layer, logically ``[B, H, N, C]``: ``B``
pool blocks, ``H`` KV heads, ``N`` tokens a block, ``C`` the content of one (head, token) cell,
K's ``head_size`` values then V's (``AttentionSpec.state_content_size_bytes``). The view may be
strided (``VLLM_KV_CACHE_LAYOUT`` permutes the physical order, e.g. ``LBNHC``), so nothing here
assumes it is contiguous.

The engine stores a layer of ``n`` blocks as ``(2, n*T, H, D)``: K then V, token-major
(``KVLayout``). Converting is a gather of the blocks' pages plus a permutation, so a round trip
is bit-exact and a block saved by vLLM reads back identical on another instance (or in the
project's own workers, which use the engine's layout).

Why not the engine's paged API (``put_kv_paged``): its pools are ``(2, NB, T, H, D)`` or
``(NB, 2, T, H, D)`` (``cuda/paged.py``), the layout of vLLM before the ``[B, H, N, C]`` views;
vLLM 0.34's page keeps K and V in the last axis, which those row plans do not describe. So the
connector gathers into a contiguous staging tensor on the pool's device (one ``index_select``
a layer) and moves that with the engine's contiguous layer calls.
"""
from __future__ import annotations

from typing import Any

from ...config import KVLayout


def check_page_view(view: Any, layout: KVLayout, name: str) -> None:
    """Raise ValueError naming what differs between a layer's view and the layout."""
    want = (layout.block_tokens, 2 * layout.head_dim)
    shape = tuple(view.shape)
    if view.dim() != 4 or shape[1] != layout.kv_heads or shape[2:] != want:
        raise ValueError(
            f"{name}: KV cache view of shape {shape}; the connector takes vLLM's [B, H, N, C] "
            f"views with H={layout.kv_heads}, N={layout.block_tokens}, C=2*{layout.head_dim} "
            f"(K then V; MLA and packed or quantized pages are not supported)")
    if view.dtype != layout.dtype:
        raise ValueError(f"{name}: KV cache dtype {view.dtype}, the layout says {layout.dtype}")


def gather_layer(view: Any, block_ids: Any, layout: KVLayout) -> Any:
    """The pages ``block_ids`` (an int64 tensor on the view's device) of one layer's view as the
    engine's contiguous ``(2, n*T, H, D)`` layer tensor (a new tensor: the copy is the gather)."""
    import torch
    d = layout.head_dim
    pages = view.index_select(0, block_ids)                   # (n, H, N, 2D)
    kv = torch.stack((pages[..., :d], pages[..., d:]))        # (2, n, H, N, D)
    return kv.permute(0, 1, 3, 2, 4).reshape(2, -1, layout.kv_heads, d)


def scatter_layer(view: Any, block_ids: Any, kv: Any, layout: KVLayout) -> None:
    """Write the engine's ``(2, n*T, H, D)`` layer tensor into the pages ``block_ids`` of one
    layer's view (in place; the view may be strided)."""
    n = block_ids.numel()
    t, h, d = layout.block_tokens, layout.kv_heads, layout.head_dim
    pages = kv.view(2, n, t, h, d).permute(1, 3, 2, 0, 4).reshape(n, h, t, 2 * d)
    view.index_copy_(0, block_ids, pages)
