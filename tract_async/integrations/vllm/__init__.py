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

EXTRA_HINT = ("install the 'vllm' extra: pip install 'tract-async[vllm]' "
              "(from a checkout: pip install -e '.[vllm]')")
_LAZY = ("TractConnector", "TractConnectorMetadata", "BlockTransfer")


def require_vllm() -> None:
    """Raise MissingExtra naming the extra when vLLM is not installed."""
    from ...errors import MissingExtra
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise
        raise MissingExtra(f"the vLLM connector needs vllm, which the core install leaves "
                           f"out: {EXTRA_HINT}") from None


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_vllm()
    from . import connector
    return getattr(connector, name)


__all__ = list(_LAZY)
