"""Optional dependencies: what the core install leaves out, and the error that names the extra.

The core library (region, lock, allocator, index, engine over a region, HTTP transport) needs
numpy, Numba, aiohttp, orjson, cbor2 and uvloop; torch is optional there (``arrays.py``: numpy
arrays without it, and ``arrays.require_torch`` names its install where it is needed). The
serving stack and ``tract demo`` also need torch, transformers (the Llama model),
prometheus-client (``/metrics``) and matplotlib (the TTFT plot); NVML telemetry needs
nvidia-ml-py. Those live in the ``serve`` extra, because they are several times the size of an
install that only moves KV blocks.
Every import of them goes through :func:`require` (or sits inside the code path that needs it),
so a core install imports and runs without them, and the serving paths fail with
:class:`~tract_async.errors.MissingExtra` naming the extra instead of a bare ``ModuleNotFoundError``.
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from types import ModuleType

from .errors import MissingExtra

EXTRA = "serve"
"""The extra that brings every optional dependency below."""

DISTRIBUTIONS: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers",
    "prometheus_client": "prometheus-client",
    "matplotlib": "matplotlib",
    "pynvml": "nvidia-ml-py",
}
"""Import name -> the distribution pip installs it from."""

INSTALL_HINT = (f"install the {EXTRA!r} extra: pip install 'tract-async[{EXTRA}]' "
                f"(from a checkout: pip install -e '.[{EXTRA}]')")


def _missing(modules: list[str], purpose: str) -> MissingExtra:
    dists = ", ".join(DISTRIBUTIONS.get(m, m) for m in modules)
    return MissingExtra(f"{purpose} needs {dists}, which the core install leaves out: "
                        f"{INSTALL_HINT}")


def require(module: str, *, purpose: str) -> ModuleType:
    """Import an optional dependency for ``purpose`` (e.g. "the serving model layer").

    Raises MissingExtra (an ImportError) naming the distribution and the extra when it is not
    installed; a broken installation of it raises its own ImportError unchanged."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:   # the package is there, one of *its* dependencies is not
            raise
        raise _missing([module], purpose) from None


def check_installed(modules: Iterable[str], *, purpose: str) -> None:
    """Fail early, before starting anything, when any of ``modules`` is not installed (found
    without importing them: transformers alone takes seconds to import). Raises MissingExtra
    naming every missing one."""
    missing: list[str] = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ValueError:          # in sys.modules as None: an import of it was blocked
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise _missing(missing, purpose)
