"""The boundary to the nixl package: importing it, UCX's environment, NIXL's errors as ours.

Kept apart from the agent (``nixl_agent``) so that configuration checks and error messages need
no NIXL (nothing here imports nixl at import time).

Environment. UCX reads ``UCX_TLS`` when NIXL creates its UCX backend (at agent creation). Where
the user did not set it, ``apply_ucx_defaults`` sets ``tcp`` (a network transport that works on
every host), plus ``cuda_copy`` when CUDA is present (NIXL's UCX backend refuses VRAM without it).
Set ``UCX_TLS`` yourself for RDMA fabrics (e.g. ``rc,cuda_copy,cuda_ipc``) or for peers on one
host (``shm,cma,tcp``).
"""
from __future__ import annotations

import os
from typing import Any

from tract_async.errors import NixlUnavailable
from tract_async.transport.errors import (
    DescriptorOutOfRange,
    InvalidDescriptors,
    NixlError,
    PeerDisconnected,
    TransferCancelled,
    TransferInProgress,
    TransportError,
)

INSTALL_HINT = ("pip install 'tract-async[nixl]' (nixl from PyPI), or for a light CPU-only "
                "install: pip install --no-deps nixl nixl-cu12")


def import_nixl() -> Any:
    """``nixl._api``. Raises NixlUnavailable (saying how to install it) when nixl does not import."""
    try:
        from nixl import _api
    except Exception as e:  # noqa: BLE001 - ImportError, or a backend wheel whose libraries fail to load
        raise NixlUnavailable(f"transport='nixl' needs the nixl package, which is not importable "
                              f"({type(e).__name__}: {e}); {INSTALL_HINT}") from e
    return _api


def nixl_version() -> str | None:
    """The installed nixl version (None when it is not installed)."""
    try:
        from importlib.metadata import version
        return version("nixl")
    except Exception:  # noqa: BLE001 - not installed, or installed without metadata
        return None


def cuda_present() -> bool:
    """Is there a CUDA device (without creating a CUDA context)?"""
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch, or a broken driver: no CUDA for UCX either
        return False


def default_ucx_tls() -> str:
    return "tcp,cuda_copy" if cuda_present() else "tcp"


def apply_ucx_defaults() -> dict[str, str]:
    """Set ``UCX_TLS`` in this process's environment unless the user set it (see the module
    docstring); returns the UCX settings in force. Called before each NIXL agent is created."""
    if not os.environ.get("UCX_TLS"):
        os.environ["UCX_TLS"] = default_ucx_tls()
    return {k: v for k, v in os.environ.items() if k.startswith("UCX_")}


NIXL_ERRORS: dict[str, type[TransportError]] = {
    "nixlRemoteDisconnectError": PeerDisconnected,
    "nixlInvalidParamError": InvalidDescriptors,
    "nixlNotFoundError": DescriptorOutOfRange,
    "nixlCancelledError": TransferCancelled,
    "nixlRepostActiveError": TransferInProgress,
}


def mapped_error(e: Exception, what: str) -> TransportError:
    """The transport error for a NIXL exception raised while doing ``what``."""
    if isinstance(e, TransportError):
        return e
    cls = NIXL_ERRORS.get(type(e).__name__, NixlError)
    return cls(f"{what}: NIXL says {type(e).__name__}: {e}")
