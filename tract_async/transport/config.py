"""The settings of an Agent (``AgentConfig``), in a module of their own.

Why not in ``http`` beside the Agent: the server handlers and the client requests read these
settings through the Protocols of ``roles``, and ``roles`` must not import ``http`` (issue 16: the
dependency goes one way, ``http`` -> ``server``/``xfer`` -> ``roles`` -> ``config``). ``http``
re-exports the class, so ``from tract_async.transport.http import AgentConfig`` keeps working.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AgentConfig"]


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Settings of one Agent. Defaults suit a KV fallback path on a trusted rack network."""

    host: str = "127.0.0.1"             # address the server binds
    port: int = 0                       # 0: the OS picks (read it back from Agent.port)
    advertise_host: str | None = None   # address peers should dial (default: host)
    secret: bytes | str | None = None   # shared HMAC secret, >= 16 bytes; required unless ...
    allow_unauthenticated: bool = False  # ... this is set, which is allowed on loopback only
    chunk_bytes: int = 4 << 20          # piece size written from / staged for registered memory
    max_request_bytes: int = 1 << 32    # largest READ or WRITE (sum of descriptor lengths)
    max_descs: int = 1 << 16            # most descriptors in one request
    max_doc_bytes: int = 8 << 20        # largest descriptor document
    max_notif_bytes: int = 64 << 10     # largest notification message
    max_app_body_bytes: int = 1 << 20   # largest body of an application (add_json_route) request
    replay_window_s: float = 30.0       # accepted clock skew and nonce memory
    io_timeout_s: float = 30.0          # longest wait for one chunk on a live connection
    connect_timeout_s: float = 5.0      # longest wait to open a connection to a peer
    transfer_timeout_s: float = 120.0   # default deadline of transfer() and call()
    max_connections_per_peer: int = 8   # pooled keep-alive connections per remote agent
    max_inflight_per_peer: int = 64     # server side: requests served at once for one authenticated
                                        # peer; more are refused with 429 (PeerBusy), so that one
                                        # peer cannot take every handler and buffer of this agent
    staging_buffers: int = 2            # pinned buffers of the CUDA path (each chunk_bytes)
