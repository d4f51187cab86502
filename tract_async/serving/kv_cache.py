"""Adapters between the engine's KV layout and a transformers ``Cache``, with per-layer hooks.

Two layouts meet here:

* the engine's, token-major, one tensor for all layers: ``(num_layers, 2, tokens, kv_heads,
  head_dim)`` (per layer, K then V); one layer is ``(2, tokens, kv_heads, head_dim)``. A block of
  ``block_tokens`` consecutive tokens is then one contiguous slice per layer, which is what the
  engine copies into a region block;
* transformers', head-major, per layer: keys and values ``(batch, kv_heads, tokens, head_dim)``.

Keys are stored *after* rotary position embedding, as transformers' attention hands them to the
cache and as vLLM stores them. The consequence: a block's K depends on the absolute positions of
its tokens, so a cached prefix is only reusable at the same offset (always the case for a prefix),
and a reader never re-applies RoPE.

Why a custom cache layer instead of forward hooks: ``LlamaAttention.forward`` calls
``cache.update(key_states, value_states, layer_idx)`` right after the K/V projections and RoPE and
right before the attention product. That one call is the exact point where (a) a prefill has the
new tokens' KV of layer ``i`` and nothing of layer ``i + 1`` has run, and (b) a decode step needs
layer ``i``'s past KV and nothing earlier. Hooks on ``self_attn`` would see K only before RoPE
(``forward_pre_hook``) or after the attention product (``forward_hook``). :class:`EngineLayer`
overrides ``update`` to call a ``notify`` callback with the new KV and, when the past is not yet
resident, a ``fetch`` callback that supplies it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from tract_async.extras import require

require("transformers", purpose="the KV cache adapters (tract_async.serving.kv_cache)")
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

from tract_async.serving.errors import KVShapeError

#: ``notify(layer_index, kv_layer)``: kv_layer is the engine layout ``(2, new_tokens, kv_heads, head_dim)``.
NotifyFn = Callable[[int, torch.Tensor], None]
#: ``fetch(layer_index)`` returns that layer's past KV in the engine layout ``(2, past_len, kv_heads, head_dim)``.
FetchFn = Callable[[int], torch.Tensor]


def layer_to_hf(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine layer ``(2, T, H, D)`` -> transformers keys, values, each ``(1, H, T, D)``, contiguous.

    Contiguous copies, because transformers concatenates onto them and the caller may reuse the
    source buffer (an engine ``out=`` tensor) for the next request.
    """
    keys = kv_layer[0].transpose(0, 1).unsqueeze(0).contiguous()
    values = kv_layer[1].transpose(0, 1).unsqueeze(0).contiguous()
    return keys, values


def hf_to_layer(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Transformers keys, values ``(1, H, T, D)`` -> a new engine layer ``(2, T, H, D)``, contiguous.

    Raises:
        KVShapeError: the batch dimension is not 1 (the serving path runs one sequence at a time).
    """
    if keys.shape[0] != 1 or values.shape[0] != 1:
        raise KVShapeError(f"expected batch size 1, got keys {tuple(keys.shape)}")
    return torch.stack((keys[0], values[0])).transpose(1, 2).contiguous()


def check_kv(
    kv: torch.Tensor,
    *,
    num_layers: int | None,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    min_tokens: int,
    what: str,
) -> None:
    """Check a KV tensor against the model's geometry; ``num_layers=None`` checks one layer.

    Raises:
        KVShapeError: wrong rank, layer count, K/V axis, heads, head_dim, dtype, or fewer than
            ``min_tokens`` tokens. The message names the expected and the found shape.
    """
    lead = () if num_layers is None else (num_layers,)
    expected = (*lead, 2, "T", kv_heads, head_dim)
    shape = tuple(kv.shape)
    ok = len(shape) == len(expected) and all(
        want == "T" or got == want for got, want in zip(shape, expected)
    )
    if not ok:
        raise KVShapeError(f"{what}: expected shape {expected}, got {shape}")
    tokens = shape[len(lead) + 1]
    if tokens < min_tokens:
        raise KVShapeError(f"{what}: expected at least {min_tokens} tokens, got {tokens}")
    if kv.dtype != dtype:
        raise KVShapeError(f"{what}: expected dtype {dtype} (the model's), got {kv.dtype}")


class EngineLayer(DynamicLayer):
    """A growing cache layer that reports new KV and can fetch its past on first use.

    ``past_len`` is the number of past tokens the layer holds or will hold once fetched. Until the
    fetch, ``get_seq_length`` reports ``past_len`` anyway: the model computes position ids and the
    causal mask from layer 0's length *before* any layer runs, and those must already count the
    past that has not landed yet.
    """

    def __init__(
        self,
        layer_index: int,
        *,
        past_len: int = 0,
        notify: NotifyFn | None = None,
        fetch: FetchFn | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self._pending_len = past_len if fetch is not None else 0
        self._notify = notify
        self._fetch = fetch

    def set_past(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Install past keys/values ``(1, H, T, D)`` (used when the past is known up front)."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def get_seq_length(self) -> int:
        if self._fetch is not None:
            return self._pending_len
        return super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fetch is not None:
            fetch, self._fetch = self._fetch, None
            kv_layer = fetch(self.layer_index)
            past_keys, past_values = layer_to_hf(kv_layer.to(key_states.device))
            self.set_past(past_keys, past_values)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self._notify is not None:
            self._notify(self.layer_index, hf_to_layer(key_states, value_states))
        return keys, values


def build_cache(
    num_layers: int,
    *,
    past_kv: torch.Tensor | None = None,
    pending_past_len: int = 0,
    notify: NotifyFn | None = None,
    fetch: FetchFn | None = None,
) -> Cache:
    """A cache of :class:`EngineLayer`, optionally pre-filled from an engine-layout ``past_kv``.

    Give either ``past_kv`` (resident now) or ``fetch`` with ``pending_past_len`` (fetched by each
    layer on its first update), not both. ``past_kv`` is copied, never aliased.
    """
    if past_kv is not None and fetch is not None:
        raise ValueError("build_cache: give past_kv or fetch, not both")
    layers = [
        EngineLayer(i, past_len=pending_past_len, notify=notify, fetch=fetch) for i in range(num_layers)
    ]
    if past_kv is not None and past_kv.shape[2] > 0:
        for i, layer in enumerate(layers):
            layer.set_past(*layer_to_hf(past_kv[i]))
    return Cache(layers=layers)


def cache_to_kv(cache: Cache) -> torch.Tensor:
    """All layers of a cache as one new engine-layout tensor ``(num_layers, 2, T, H, D)``."""
    per_layer = [torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers]
    return torch.stack(per_layer).transpose(2, 3).contiguous()
