"""What the server handlers and the client requests need of an agent, as Protocols.

``server`` (the aiohttp handlers) and ``xfer`` (transfer handles, the requests) are free functions
over an agent. They used to annotate it as ``http.Agent``, which made each of them and ``http``
import one another (issue 16): neither side could be read or tested without the whole Agent.
These Protocols name the part of an agent each side reads, so the dependency goes one way:

    http (Agent) -> server, xfer -> roles -> config, auth, descs, wire, conn

``Agent`` satisfies both Protocols structurally (it names neither); a type checker verifies it
where the Agent hands itself over (``app[AGENT_KEY] = self``, ``XferHandle.create(self, ...)``).
A test double can satisfy them with the few attributes listed here.
"""
from __future__ import annotations

from collections import Counter
from typing import Protocol

import aiohttp

from tract_async.transport import wire
from tract_async.transport.auth import Signer, Verifier
from tract_async.transport.config import AgentConfig
from tract_async.transport.conn import ReadPool
from tract_async.transport.descs import MemoryRegistry, StagingPool

__all__ = ["AgentCore", "SendingAgent", "ServingAgent"]


class AgentCore(Protocol):
    """Read by both sides: the settings, the registered memory, the staging buffers of the CUDA
    path (``descs.Span``), the counters."""

    name: str
    config: AgentConfig
    registry: MemoryRegistry
    staging: StagingPool
    stats: Counter[str]
    closing: bool     # set once by close(); handlers refuse new requests from then on


class ServingAgent(AgentCore, Protocol):
    """The agent behind the aiohttp handlers of ``server`` (reached as ``app[AGENT_KEY]``)."""

    instance: str          # requests signed for another incarnation are refused (``auth``)
    verifier: Verifier
    inflight: dict[str, int]   # authenticated peer -> requests being served (``server._admit``)

    def deliver_notif(self, sender: str, msg: bytes) -> None:
        """Queue a notification that arrived (WRITE or standalone) and wake its waiters."""

    def get_agent_metadata(self) -> bytes:
        """This agent's encoded metadata (``wire``), served to peers that bootstrap from a URL."""


class SendingAgent(AgentCore, Protocol):
    """The agent on whose behalf ``xfer`` builds handles and sends requests."""

    signer: Signer

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled aiohttp client (WRITE, READ into VRAM, control requests)."""

    @property
    def read_pool(self) -> ReadPool:
        """The keep-alive connections of the direct READ path into DRAM (``conn``)."""

    def remote_agent(self, name: str) -> wire.AgentMetadata:
        """A peer's published metadata. Raises UnknownRemoteAgent."""
