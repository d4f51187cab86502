"""The model layer of the serving stack: what prefill and decode workers call.

* :mod:`.model`: Llama configs (tiny CPU model, Llama-3-8B geometry), seeded random-weight builds,
  KV geometry for the engine, layer-wise prefill after a cached prefix, decode from given KV, and
  the single-process reference generation.
* :mod:`.streaming`: the async forms, storing (prefill) or awaiting (decode) KV layer by layer.
* :mod:`.kv_cache`: the adapters between the engine's KV layout and transformers' cache.
* :mod:`.tokenizer`: a byte-level tokenizer and chat template (no hub downloads).
* :mod:`.metrics`: per-service Prometheus metrics and the ``/metrics`` handler.

Importing this package builds nothing and imports nothing heavy: the names below are resolved on
first use (PEP 562), so a router that only needs the tokenizer or the metrics does not pay for
importing torch and transformers (seconds).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "BadCompletionRequest": "errors",
    "ChatTemplateError": "errors",
    "KVPoolFull": "errors",
    "KVUnavailable": "errors",
    "ServiceConfigError": "errors",
    "ServiceStartFailed": "errors",
    "UpstreamFailed": "errors",
    "KVShapeError": "errors",
    "LayerWaitTimeout": "errors",
    "NothingToCompute": "errors",
    "ServingError": "errors",
    "TokenIdError": "errors",
    "TokenizerError": "errors",
    "ServiceMetrics": "metrics",
    "metrics_handler": "metrics",
    "KVGeometry": "model",
    "PrefillResult": "model",
    "build_model": "model",
    "decode": "model",
    "kv_layout_for": "model",
    "llama3_8b_config": "model",
    "prefill": "model",
    "reference_generate": "model",
    "tiny_llama_config": "model",
    "weights_digest": "model",
    "decode_streaming": "streaming",
    "generate_streaming": "streaming",
    "prefill_streaming": "streaming",
    "ByteTokenizer": "tokenizer",
    "render_chat": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tract_async.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tract_async.serving.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from tract_async.serving.errors import (BadCompletionRequest, ChatTemplateError, KVPoolFull,
                                            KVShapeError, KVUnavailable, LayerWaitTimeout,
                                            NothingToCompute, ServiceConfigError,
                                            ServiceStartFailed, ServingError, TokenIdError,
                                            TokenizerError, UpstreamFailed)
    from tract_async.serving.metrics import ServiceMetrics, metrics_handler
    from tract_async.serving.model import (KVGeometry, PrefillResult, build_model, decode,
                                           kv_layout_for, llama3_8b_config, prefill,
                                           reference_generate, tiny_llama_config, weights_digest)
    from tract_async.serving.streaming import decode_streaming, generate_streaming, prefill_streaming
    from tract_async.serving.tokenizer import ByteTokenizer, render_chat
