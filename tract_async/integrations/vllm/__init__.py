"""tract_async as a vLLM KV connector (``pip install 'tract-async[vllm]'``).

``--kv-transfer-config '{"kv_connector": "TractConnector", "kv_connector_module_path":
"tract_async.integrations.vllm", ...}'``: vLLM imports this package and reads
``TractConnector`` from it (README, "Use with vLLM"; ``connector.py`` for how it works).

The package itself imports no vLLM: ``TractConnector`` (and ``TractConnectorMetadata``) are
resolved on first access, so that the core install can import every module it ships and a
missing vLLM fails with MissingExtra naming the extra, not a bare ModuleNotFoundError.
``bridge``, ``pages`` and ``settings`` need no vLLM at all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import TractConnector, TractConnectorMetadata

from .requirement import EXTRA_HINT, require_vllm  # noqa: F401 (the package's face)

_LAZY = ("TractConnector", "TractConnectorMetadata", "BlockTransfer")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_vllm()
    from . import connector
    return getattr(connector, name)


__all__ = list(_LAZY)
