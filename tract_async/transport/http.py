"""NIXL-style agent over aiohttp: the fallback transport where no shared region reaches.

The concepts and names follow NIXL's Python API (``nixl._api.nixl_agent``) so code written for
one reads naturally against the other: an *agent* registers memory, publishes *metadata* that
peers add with ``add_remote_agent``, builds *descriptor lists* with ``get_xfer_descs``, creates a
READ or WRITE transfer with ``initialize_xfer`` and exchanges *notifications*. What differs, on
purpose:

* the API is asyncio: ``await agent.transfer(handle, timeout=...)`` runs a transfer to completion
  under a deadline; ``post_xfer`` + ``check_xfer_state`` give NIXL-style polling;
* one error channel: a failed transfer raises (``transport.errors``); status strings only say
  "INIT", "PROC" or "DONE";
* every request is authenticated (HMAC, replay window, signed for its recipient's name and
  instance; see ``auth``) unless the agent opted out explicitly on loopback, and every
  descriptor is bounds-checked against registered memory.

Data path. A READ is one POST per transfer: the body names the remote descriptors; the server
(aiohttp) answers with their bytes, written straight from memoryviews of registered memory. Into
DRAM the client (``conn``, HTTP/1.1 over a BufferedProtocol, not aiohttp's client) has the kernel
write the body directly into the destination memoryview: no user-space copy, no allocation per
read. Into VRAM it stages through pinned buffers over aiohttp. A WRITE streams the local bytes
in the request body over aiohttp. Connections are pooled per peer (keep-alive) and several
transfers may be in flight. The reader of a READ sends the notification after the last byte
landed, so a notification always means "the bytes are there".

Typical use (a decode worker pulling KV from a prefill worker)::

    prefill = Agent("prefill", secret=s)           # serves its KV pool
    prefill.register_memory(kv_pool, name="kv")
    await prefill.start()
    decode = Agent("decode", secret=s)
    decode.register_memory(dst)
    await decode.start()
    peer = decode.add_remote_agent(prefill.get_agent_metadata())
    h = decode.initialize_xfer("READ", decode.get_xfer_descs(dst), remote_descs, peer, b"req-7")
    await decode.transfer(h, timeout=5.0)
    h.release()
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tract_async.transport import wire
from tract_async.transport.auth import Signer, Verifier, coerce_secret, key_id, new_instance
from tract_async.transport.config import AgentConfig
from tract_async.transport.conn import ReadPool
from tract_async.transport.descs import MemoryRegistry, RegionInfo, StagingPool, XferDescList
from tract_async.transport.errors import (
    AgentClosed,
    InvalidDescriptors,
    NotificationTimeout,
    TransportConfigError,
    UnknownRemoteAgent,
)
from tract_async.transport.server import (
    AGENT_KEY,
    JsonHandler,
    handle_identity,
    handle_metadata,
    handle_notif,
    handle_read,
    handle_write,
    json_route,
)
from tract_async.transport.xfer import XferHandle, call_remote, fetch_metadata, run_xfer, send_notif

__all__ = ["Agent", "AgentConfig", "XferHandle", "XferDescList", "RegionInfo"]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Agent:
    """A transfer agent: registered memory, an aiohttp server that serves it, a pooled client.

    Lifecycle: construct, ``register_memory`` / ``add_json_route``, ``await start()``, transfer,
    ``await close()`` (idempotent; also ``async with Agent(...)``).
    """

    def __init__(self, name: str, config: AgentConfig | None = None, /, **overrides: Any) -> None:
        """``overrides`` replace fields of ``config`` (e.g. ``Agent("a", secret=s, port=0)``).

        Raises TransportConfigError: no secret without ``allow_unauthenticated``, unauthenticated
        mode on a non-loopback host, a too-short secret, an empty or unprintable name or bad limits.
        """
        cfg = dataclasses.replace(config or AgentConfig(), **overrides)
        if not name or len(name) > 256 or not name.isprintable():
            raise TransportConfigError("agent name must be 1..256 printable characters (it travels in HTTP headers)")
        secret = coerce_secret(cfg.secret)
        if secret is None:
            if not cfg.allow_unauthenticated:
                raise TransportConfigError(
                    "a shared secret is required: pass secret=... (>= 16 bytes), or "
                    "allow_unauthenticated=True for a loopback-only test setup")
            if not _is_loopback(cfg.host) or (cfg.advertise_host and not _is_loopback(cfg.advertise_host)):
                raise TransportConfigError(
                    f"unauthenticated mode is only allowed on loopback, not on host {cfg.host!r}")
        if (cfg.chunk_bytes < 4096 or cfg.max_request_bytes < 1 or cfg.max_descs < 1
                or cfg.max_inflight_per_peer < 1):
            raise TransportConfigError("chunk_bytes must be >= 4096, limits must be positive")
        self.name = name
        self.instance = new_instance()   # this incarnation: requests signed for another are refused
        self.config = cfg
        self.registry = MemoryRegistry()
        self.staging = StagingPool(cfg.chunk_bytes, cfg.staging_buffers)
        self.signer = Signer(name, secret)
        self.verifier = Verifier(secret, name=name, instance=self.instance, window_s=cfg.replay_window_s)
        self.stats: Counter[str] = Counter()
        self.inflight: dict[str, int] = {}   # authenticated peer -> requests being served (server)
        self.closing = False
        self._key_id = key_id(secret)
        self._remotes: dict[str, wire.AgentMetadata] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._notif_event = asyncio.Event()
        self._json_routes: dict[str, JsonHandler] = {}
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._session: aiohttp.ClientSession | None = None
        self._read_pool: ReadPool | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handles: set[XferHandle] = set()

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the server and open the client pool.

        Raises AgentClosed (started twice, or after close), OSError (the port is taken).
        """
        if self._runner is not None or self.closing:
            raise AgentClosed(f"agent {self.name!r} was already started")
        app = web.Application(client_max_size=self.config.max_app_body_bytes)
        app[AGENT_KEY] = self
        app.router.add_post(wire.PATH_READ, handle_read)
        app.router.add_post(wire.PATH_WRITE, handle_write)
        app.router.add_post(wire.PATH_NOTIF, handle_notif)
        app.router.add_get(wire.PATH_METADATA, handle_metadata)
        app.router.add_get(wire.PATH_IDENTITY, handle_identity)
        for path, handler in self._json_routes.items():
            app.router.add_post(path, json_route(handler))
        app.cleanup_ctx.append(self._client_ctx)
        runner = web.AppRunner(app, access_log=None, read_bufsize=1 << 20, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = runner.addresses[0][1]

    async def _client_ctx(self, app: web.Application) -> Any:
        """cleanup_ctx: the pooled client session lives exactly as long as the server."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.config.max_connections_per_peer,
                                         keepalive_timeout=30.0)
        self._session = aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20,
                                              auto_decompress=False, skip_auto_headers=("User-Agent",))
        self._read_pool = ReadPool(self.config.max_connections_per_peer, self.config.connect_timeout_s)
        yield
        session, self._session = self._session, None
        pool, self._read_pool = self._read_pool, None
        pool.close()
        await session.close()

    async def close(self) -> None:
        """Cancel in-flight transfers and wait until no more bytes can land, release every handle,
        stop the server (which closes the client pool, see ``_client_ctx``), wake notification
        waiters. Idempotent; a failure of the server cleanup is raised after everything else ran.
        """
        if self.closing and self._runner is None:
            return
        self.closing = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for h in list(self._handles):
            h.release()
        runner, self._runner = self._runner, None
        try:
            if runner is not None:
                await runner.cleanup()
        finally:
            self._wake()

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def started(self) -> bool:
        """Whether the agent is bound (``port`` would answer)."""
        return self._port is not None

    @property
    def port(self) -> int:
        """The bound port. Raises AgentClosed before start()."""
        if self._port is None:
            raise AgentClosed(f"agent {self.name!r} is not started")
        return self._port

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self.closing:
            raise AgentClosed(f"agent {self.name!r} is not started or is closed")
        return self._session

    @property
    def read_pool(self) -> ReadPool:
        """The keep-alive connections of the direct READ path (``conn``)."""
        if self._read_pool is None or self.closing:
            raise AgentClosed(f"agent {self.name!r} is not started or is closed")
        return self._read_pool

    # --- memory -------------------------------------------------------------------------------
    def register_memory(self, mem: Any, *, name: str | None = None, writable: bool = True) -> RegionInfo:
        """Expose ``mem`` to peers (and make it usable as a local transfer side).

        ``mem``: a contiguous torch tensor (CPU or CUDA), a C-contiguous numpy array, a writable
        buffer, or a raw ``(address, nbytes)`` range of a mapping the caller keeps alive.
        ``writable=False`` refuses remote WRITEs into it (READ-only KV export). Memory registered
        after ``get_agent_metadata`` reaches peers only with fresh metadata.

        Raises InvalidDescriptors (cannot be registered), MemoryAlreadyRegistered (overlap, name).
        """
        return self.registry.register(mem, name=name, writable=writable)

    def deregister_memory(self, name: str) -> None:
        """Raises MemoryNotRegistered (unknown name), TransferInProgress (a transfer uses it)."""
        self.registry.deregister(name)

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> XferDescList:
        """A descriptor list from (as in NIXL) a tensor, a list of tensors, a list of
        ``(addr, nbytes, dev_id)`` tuples or an N x 3 array (with ``mem_type``, default "DRAM"),
        or a RegionInfo / list of RegionInfo (whole ranges). An XferDescList passes through.

        Raises InvalidDescriptors.
        """
        from ..arrays import is_tensor   # no torch import: without one loaded, nothing is a tensor

        if isinstance(descs, XferDescList):
            return descs
        if is_tensor(descs) or isinstance(descs, RegionInfo):
            descs = [descs]
        if isinstance(descs, (list, tuple)) and descs and is_tensor(descs[0]):
            types = {"VRAM" if t.is_cuda else "DRAM" for t in descs}
            if len(types) != 1 or not all(t.is_contiguous() for t in descs):
                raise InvalidDescriptors("tensors of one descriptor list must be contiguous and on one kind of device")
            rows = [(t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0)) for t in descs]
            return XferDescList(rows, types.pop())
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], RegionInfo):
            types = {r.mem_type for r in descs}
            if len(types) != 1:
                raise InvalidDescriptors("regions of one descriptor list must share a memory type")
            return XferDescList([r.desc() for r in descs], types.pop())
        return XferDescList(descs, mem_type or "DRAM")

    # --- metadata -----------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        """This agent's metadata (versioned orjson; see ``wire``). Raises AgentClosed before start()."""
        md = wire.AgentMetadata(
            name=self.name, instance=self.instance, host=self.config.advertise_host or self.config.host,
            port=self.port, auth="none" if self._key_id == "none" else "hmac", key_id=self._key_id,
            regions=tuple(self.registry.infos()))
        return wire.encode_metadata(md)

    def add_remote_agent(self, metadata: bytes) -> str:
        """Learn a peer from its metadata (replacing an older copy); returns its name.

        Raises MetadataError / MetadataVersionMismatch (bad metadata), TransportConfigError
        (the peer uses another shared secret, or none while we require one).
        """
        md = wire.decode_metadata(metadata)
        if md.key_id != self._key_id:
            raise TransportConfigError(
                f"remote agent {md.name!r} uses a different shared secret (key id {md.key_id}, ours "
                f"{self._key_id}); give both agents the same secret")
        self._remotes[md.name] = md
        return md.name

    def remove_remote_agent(self, name: str) -> None:
        """Forget a peer. In-flight transfers to it finish or fail on their own. Idempotent."""
        self._remotes.pop(name, None)

    def remote_agent(self, name: str) -> wire.AgentMetadata:
        """Raises UnknownRemoteAgent."""
        try:
            return self._remotes[name]
        except KeyError:
            raise UnknownRemoteAgent(f"no remote agent {name!r}; add its metadata with add_remote_agent") from None

    def remote_region(self, agent: str, region: str) -> RegionInfo:
        """The range a peer registered under ``region`` (for building remote descriptors by name).

        Raises UnknownRemoteAgent, MemoryNotRegistered.
        """
        from tract_async.transport.errors import MemoryNotRegistered

        for r in self.remote_agent(agent).regions:
            if r.name == region:
                return r
        raise MemoryNotRegistered(f"remote agent {agent!r} registered no region named {region!r}")

    async def fetch_remote_metadata(self, base_url: str, *, timeout: float | None = None) -> str:
        """GET a peer's metadata from its server, add it, return its name.

        Two requests: the unsigned identity route says whom to sign for (name and instance), then
        the metadata GET is signed for that agent like any request (see ``auth``).
        Raises PeerUnreachable, AuthenticationFailed, TransferTimeout, MetadataError,
        MetadataVersionMismatch (the peer speaks another protocol version), ...
        """
        data = await fetch_metadata(self, base_url, timeout or self.config.transfer_timeout_s)
        return self.add_remote_agent(data)

    # --- transfers ----------------------------------------------------------------------------
    def initialize_xfer(self, operation: str, local_descs: XferDescList, remote_descs: XferDescList,
                        remote_name: str, notif_msg: bytes = b"") -> XferHandle:
        """A transfer between pairwise equal-length descriptors (not yet posted).

        READ copies remote -> local, WRITE local -> remote. Local descriptors are checked against
        this agent's registry, remote ones against the peer's published metadata (the peer checks
        them again). Raises InvalidDescriptors, MemoryNotRegistered, DescriptorOutOfRange,
        UnknownRemoteAgent, RequestTooLarge, AgentClosed.
        """
        if self.closing:
            raise AgentClosed(f"agent {self.name!r} is closed")
        handle = XferHandle.create(self, operation, local_descs, remote_descs, remote_name, bytes(notif_msg),
                                   on_release=self._handles.discard)
        self._handles.add(handle)   # close() releases what the caller did not
        return handle

    def post_xfer(self, handle: XferHandle) -> str:
        """Start the transfer in the background (NIXL's ``transfer``); returns "PROC".

        Poll with ``check_xfer_state`` or wait with ``transfer``. Raises HandleReleased,
        TransferInProgress, AgentClosed.
        """
        handle.check_postable()
        session = self.session
        task = asyncio.get_running_loop().create_task(run_xfer(self, session, handle))
        self._tasks.add(task)   # owned by the agent: close() cancels and awaits it
        task.add_done_callback(self._tasks.discard)
        handle.started(task)
        return "PROC"

    async def transfer(self, handle: XferHandle, *, timeout: float | None = None) -> None:
        """Run the transfer to completion under a deadline: wait for it if it is posted and its
        outcome not yet seen (e.g. after post_xfer), else post it (again).

        On timeout or cancellation the transfer is cancelled and awaited before this returns,
        so no more bytes can land. Raises TransferTimeout, PeerUnreachable, PeerDisconnected,
        TruncatedBody, AuthenticationFailed, DescriptorOutOfRange, RemoteError, ...
        """
        if not handle.awaiting_report:
            self.post_xfer(handle)
        await handle.wait(timeout if timeout is not None else self.config.transfer_timeout_s)

    def check_xfer_state(self, handle: XferHandle) -> str:
        """"INIT", "PROC" or "DONE"; a failed transfer raises its exception here (every poll).

        Raises HandleReleased and whatever the transfer failed with.
        """
        return handle.poll()

    def release_xfer_handle(self, handle: XferHandle) -> None:
        """Same as ``handle.release()``. Idempotent."""
        handle.release()

    # --- notifications ------------------------------------------------------------------------
    def deliver_notif(self, sender: str, msg: bytes) -> None:
        """Server side: queue a notification from ``sender`` and wake waiters (never blocks)."""
        self._notifs.setdefault(sender, []).append(msg)
        self.stats["notifs_received"] += 1
        self._wake()

    def _wake(self) -> None:
        # One Event per generation: waiters hold the current one, a delivery sets it and starts the next.
        ev, self._notif_event = self._notif_event, asyncio.Event()
        ev.set()

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """All notifications since the last call, by sender name (as NIXL's get_new_notifs)."""
        out, self._notifs = self._notifs, {}
        return {k: v for k, v in out.items() if v}

    async def wait_notif(self, sender: str, msg: bytes | None = None, *, prefix: bool = False,
                         timeout: float) -> bytes:
        """Wait for (and consume) a notification from ``sender``: any message, one equal to ``msg``,
        or (``prefix=True``) one starting with it.

        Raises NotificationTimeout, AgentClosed.
        """
        def take() -> bytes | None:
            q = self._notifs.get(sender, [])
            for i, m in enumerate(q):
                if msg is None or m == msg or (prefix and m.startswith(msg)):
                    del q[i]
                    if not q:
                        self._notifs.pop(sender, None)
                    return m
            return None

        try:
            async with asyncio.timeout(timeout):
                while (found := take()) is None:
                    if self.closing:
                        raise AgentClosed(f"agent {self.name!r} closed while waiting for a notification")
                    await self._notif_event.wait()
                return found
        except TimeoutError:
            raise NotificationTimeout(f"no notification from {sender!r} matching {msg!r} within {timeout:g} s") from None

    async def send_notif(self, remote_name: str, msg: bytes, *, timeout: float | None = None) -> None:
        """A standalone notification. Raises UnknownRemoteAgent, PeerUnreachable, TransferTimeout, ..."""
        await send_notif(self, self.remote_agent(remote_name), bytes(msg),
                         timeout or self.config.transfer_timeout_s)

    # --- application routes -----------------------------------------------------------------
    def add_json_route(self, path: str, handler: Callable[[str, Any], Awaitable[Any]]) -> None:
        """Serve ``POST path`` with ``await handler(sender_name, json_payload) -> json_result``,
        authenticated like transfers (e.g. an engine's key -> descriptors lookup). Call before start.

        Raises TransportConfigError (after start, reserved ``/tract/`` prefix, duplicate path).
        """
        if self._runner is not None:
            raise TransportConfigError("add_json_route must be called before start()")
        if not path.startswith("/") or path.startswith("/tract/") or path in self._json_routes:
            raise TransportConfigError(f"route path {path!r} must start with '/', not be under /tract/, and be new")
        self._json_routes[path] = handler

    async def call(self, remote_name: str, path: str, payload: Any = None, *, timeout: float | None = None) -> Any:
        """POST ``payload`` as JSON to a peer's ``add_json_route`` endpoint; returns the decoded reply.

        Raises UnknownRemoteAgent, PeerUnreachable, TransferTimeout, AuthenticationFailed,
        RemoteError (the handler failed), ...
        """
        body = orjson.dumps(payload)
        return await call_remote(self, self.remote_agent(remote_name), path, body,
                                 timeout or self.config.transfer_timeout_s)
