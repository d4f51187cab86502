"""Whether vLLM is installed: the connector's first import, and the package's lazy exports.

Its own module so that ``connector.py`` need not import the package ``__init__`` that resolves
``TractConnector`` from it (an import cycle, issue 37).
"""
from __future__ import annotations

EXTRA_HINT = ("install the 'vllm' extra: pip install 'tract-async[vllm]' "
              "(from a checkout: pip install -e '.[vllm]')")


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
