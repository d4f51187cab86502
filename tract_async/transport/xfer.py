"""Client side of the HTTP transport: transfer handles and the requests an Agent sends.

A transfer runs as one task owned by its agent (``Agent._tasks``; ``close`` cancels and awaits
them). Cancellation is honest: a handle reports cancelled or timed out only after its task has
finished, i.e. when no more bytes can land in the destination.

The agent is seen only as a ``roles.SendingAgent``: this module never imports ``http``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import payload as aio_payload
from aiohttp.abc import AbstractStreamWriter

from tract_async.transport import wire
from tract_async.transport.auth import PROTOCOL
from tract_async.transport.conn import build_request, raise_for_error
from tract_async.transport.descs import RegionInfo, Span, XferDescList
from tract_async.transport.errors import (
    ERROR_CODES,
    DescriptorOutOfRange,
    HandleReleased,
    InvalidDescriptors,
    InvalidOperation,
    MetadataError,
    MetadataVersionMismatch,
    PeerDisconnected,
    PeerUnreachable,
    RemoteError,
    TransferCancelled,
    TransferInProgress,
    TransferTimeout,
    TransportError,
    TruncatedBody,
)
from tract_async.transport.roles import SendingAgent
from tract_async.transport.server import fill_spans


class XferHandle:
    """One READ or WRITE between local and remote descriptor lists (NIXL's nixl_xfer_handle).

    ``state`` is "INIT" (never posted), "PROC" (in flight), "DONE", "ERR" (the error is raised by
    ``poll``/``transfer``) or "RELEASED". A DONE or ERR handle may be posted again. ``bytes_done``
    counts payload bytes moved so far (a progress gauge, reset on each post).
    """

    def __init__(self, agent: SendingAgent, op: str, local: XferDescList, remote: XferDescList,
                 remote_name: str, notif: bytes, local_spans: list[Span],
                 on_release: Callable[[XferHandle], None]) -> None:
        self.agent = agent
        self._on_release = on_release
        self.op = op
        self.local = local
        self.remote = remote
        self.remote_name = remote_name
        self.notif = notif
        self.local_spans = local_spans
        self.total_bytes = local.total_bytes
        # DRAM destinations take the direct READ path (conn.py); VRAM ones stage through aiohttp.
        self.direct = op == "READ" and all(s.reg.info.mem_type == "DRAM" for s in local_spans)
        self.state = "INIT"
        self.bytes_done = 0
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._cancel_reason: TransportError | None = None
        self._settled: asyncio.Task[None] | None = None
        self._reported = True   # the outcome of the last post was seen by transfer() or a poll

    @classmethod
    def create(cls, agent: SendingAgent, op: str, local: XferDescList, remote: XferDescList,
               remote_name: str, notif: bytes, *, on_release: Callable[[XferHandle], None]) -> XferHandle:
        """A checked handle. ``on_release`` runs once, on the first ``release()``: the agent
        keeps its live handles (``close`` releases them) and passes how to forget one.

        Raises InvalidOperation, InvalidDescriptors, DescriptorOutOfRange, UnknownRemoteAgent,
        MemoryNotRegistered.
        """
        check_pairing(op, local, remote)
        if len(notif) > agent.config.max_notif_bytes:
            raise InvalidDescriptors(f"notif_msg of {len(notif)} bytes, the limit is {agent.config.max_notif_bytes}")
        md = agent.remote_agent(remote_name)
        check_remote(md, remote, for_write=op == "WRITE")
        spans = agent.registry.spans(local.rows, local.mem_type, for_write=False, local=True)
        return cls(agent, op, local, remote, remote_name, notif, spans, on_release)

    def __repr__(self) -> str:
        return f"XferHandle({self.op} {self.total_bytes} B with {self.remote_name!r}, {self.state})"

    def check_postable(self) -> None:
        if self.state == "RELEASED":
            raise HandleReleased("this transfer handle was released")
        if self.state == "PROC":
            raise TransferInProgress("this transfer is already in flight; await transfer() or poll it")

    def started(self, task: asyncio.Task[None]) -> None:
        self.state, self._task, self._error, self._cancel_reason = "PROC", task, None, None
        self.bytes_done = 0
        self._reported = False
        for s in self.local_spans:  # held from post until the task is done: no reuse under a transfer
            s.reg.users += 1
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        """Settle the outcome of ``task`` exactly once (done callback, or an earlier poll)."""
        if task is self._settled:
            return
        self._settled = task
        for s in self.local_spans:
            s.reg.users -= 1
        if self.state == "RELEASED" or task is not self._task:
            return
        if task.cancelled():
            self._error = self._cancel_reason or TransferCancelled("the transfer was cancelled")
        else:
            self._error = task.exception()
        self.state = "ERR" if self._error is not None else "DONE"

    @property
    def awaiting_report(self) -> bool:
        """Posted, and its outcome not yet seen: transfer() waits for it instead of posting again."""
        return self.state == "PROC" or (self.state in ("DONE", "ERR") and not self._reported)

    def poll(self) -> str:
        """The state; raises the failure of a failed transfer (and HandleReleased after release)."""
        if self.state == "RELEASED":
            raise HandleReleased("this transfer handle was released")
        if self.state == "PROC" and self._task is not None and self._task.done():
            self._finished(self._task)  # done, but its callback has not run yet
        if self.state in ("DONE", "ERR"):
            self._reported = True
        if self.state == "ERR":
            assert self._error is not None
            raise self._error
        return self.state

    async def wait(self, timeout: float) -> None:
        """Wait for the posted transfer; on deadline or cancellation cancel it and wait it out."""
        task = self._task
        assert task is not None, "XferHandle.wait before post"
        if task.done():
            self.poll()
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(task)
        except TransportError:
            raise
        except TimeoutError:
            if not task.done():
                self._cancel_reason = TransferTimeout(
                    f"{self.op} of {self.total_bytes} bytes with {self.remote_name!r} did not finish within "
                    f"{timeout:g} s ({self.bytes_done} bytes moved); it was cancelled")
                task.cancel()
                await asyncio.wait([task])  # honest cancel: no more bytes land after this
            self.poll()
            raise  # pragma: no cover - poll raised
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait([task])
            raise
        self.poll()

    def release(self) -> None:
        """Forget the handle; an in-flight transfer is cancelled (its task is awaited by close()).

        Idempotent. Pair with ``await transfer`` before release when the bytes matter.
        """
        if self.state == "RELEASED":
            return
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.state = "RELEASED"
        self._on_release(self)


def check_pairing(op: str, local: XferDescList, remote: XferDescList) -> None:
    """A READ or WRITE of descriptor lists that pair up one to one with equal lengths.
    Raises InvalidOperation, InvalidDescriptors."""
    if op not in ("READ", "WRITE"):
        raise InvalidOperation(f'operation must be "READ" or "WRITE", got {op!r}')
    if not isinstance(local, XferDescList) or not isinstance(remote, XferDescList):
        raise InvalidDescriptors("pass descriptor lists (XferDescList, from get_xfer_descs)")
    if len(local) != len(remote) or (local.rows[:, 1] != remote.rows[:, 1]).any():
        raise InvalidDescriptors(
            f"local and remote lists must pair up one to one with equal lengths "
            f"({len(local)} local, {len(remote)} remote descriptors)")


class PublishedRanges(Protocol):
    """What ``check_remote`` needs of a peer: its name and the ranges it published (the HTTP
    agent's ``wire.AgentMetadata``, the NIXL agent's record of a peer)."""
    name: str
    regions: tuple[RegionInfo, ...]


def check_remote(md: PublishedRanges, remote: XferDescList, *, for_write: bool) -> None:
    """Check remote descriptors against the peer's published ranges (it checks again itself).
    Raises DescriptorOutOfRange."""
    regions = [r for r in md.regions if r.mem_type == remote.mem_type]
    for k, (addr, n, dev) in enumerate(remote.rows.tolist()):
        for r in regions:
            if r.dev_id == dev and r.addr <= addr and addr + n <= r.addr + r.nbytes:
                if for_write and not r.writable:
                    raise DescriptorOutOfRange(f"remote descriptor {k} targets {md.name!r}'s read-only region {r.name!r}")
                break
        else:
            raise DescriptorOutOfRange(
                f"remote descriptor {k} [{addr:#x}, +{n}) is not inside memory {md.name!r} registered "
                "(stale metadata? fetch it again after the peer registers memory)")


class _SpansPayload(aio_payload.Payload):
    """A request body written straight from registered memory, chunk by chunk, with a known size."""

    def __init__(self, head: bytes, spans: list[Span], agent: SendingAgent, handle: XferHandle) -> None:
        super().__init__(None, content_type="application/octet-stream")
        self._head, self._spans, self._agent, self._handle = head, spans, agent, handle
        self._size = len(head) + sum(s.nbytes for s in spans)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a transfer body is binary")

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        await writer.write(self._head)
        for span in self._spans:
            async for piece in span.read_pieces(self._agent.config.chunk_bytes, self._agent.staging):
                await writer.write(piece)
                self._handle.bytes_done += len(piece)


def _client_timeout(agent: SendingAgent) -> aiohttp.ClientTimeout:
    cfg = agent.config
    return aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.io_timeout_s)


async def _raise_for_error(resp: aiohttp.ClientResponse, peer: str) -> None:
    code = resp.headers.get(wire.H_ERROR, "")
    try:
        msg = str(orjson.loads(await resp.content.read(64 << 10)).get("message"))
    except (orjson.JSONDecodeError, AttributeError, aiohttp.ClientError):
        msg = f"HTTP {resp.status} {resp.reason}"
    raise ERROR_CODES.get(code, RemoteError)(f"{peer}: {msg}")


async def _mapped(peer: str, what: str, coro: Callable[[], Awaitable[Any]]) -> Any:
    """Run one client exchange, translating aiohttp/OS failures into transport errors."""
    try:
        return await coro()
    except TransportError:
        raise
    except aiohttp.ServerTimeoutError as e:
        raise TransferTimeout(f"{what} with {peer!r}: peer stalled ({e})") from e
    except aiohttp.ClientConnectorError as e:
        raise PeerUnreachable(f"{what}: cannot connect to {peer!r} ({e})") from e
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
        raise PeerDisconnected(f"{what}: {peer!r} went away mid-transfer ({type(e).__name__}: {e})") from e
    except TimeoutError as e:
        # before OSError, of which TimeoutError is a subclass: a caller's timeout (asyncio.timeout
        # around the exchange) is a slow peer, not a gone one (which the stores drop)
        raise TransferTimeout(f"{what} with {peer!r}: no answer within the timeout "
                              f"({e or 'the io timeout'})") from e
    except (aiohttp.ClientError, OSError) as e:
        raise PeerDisconnected(f"{what} with {peer!r} failed: {type(e).__name__}: {e}") from e


async def run_xfer(agent: SendingAgent, session: aiohttp.ClientSession, h: XferHandle) -> None:
    """The body of one transfer task (see XferHandle)."""
    md = agent.remote_agent(h.remote_name)
    doc = wire.encode_doc(h.remote.to_wire(), h.remote.mem_type, h.notif if h.op == "WRITE" else b"")
    head = wire.DOC_LEN.pack(len(doc)) + doc
    if h.op == "READ":
        if h.direct:
            await _mapped(md.name, "READ", lambda: _read_direct(agent, md, h, head, doc))
        else:
            await _mapped(md.name, "READ", lambda: _read(agent, session, md, h, head, doc))
        if h.notif:  # after the last byte landed, so the notification means "bytes are there"
            await send_notif(agent, md, h.notif, agent.config.io_timeout_s, session)
    else:
        await _mapped(md.name, "WRITE", lambda: _write(agent, session, md, h, head, doc))
    agent.stats[f"{h.op.lower()}s"] += 1
    agent.stats["bytes_moved"] += h.total_bytes


async def _read_direct(agent: SendingAgent, md: wire.AgentMetadata, h: XferHandle, head: bytes, doc: bytes) -> None:
    """A READ into DRAM: the response body lands straight in the local spans (see ``conn``)."""
    headers = agent.signer.headers("POST", wire.PATH_READ, doc, to=md.name, to_instance=md.instance)
    request = build_request(wire.PATH_READ, md.http_host, headers, head)
    resp, err = await agent.read_pool.read(md.host, md.port, md.name, request, h.local_spans, h.total_bytes,
                                           h, agent.config.io_timeout_s)
    if resp.status != 200:
        raise_for_error(resp, err, md.name)


async def _read(agent: SendingAgent, session: aiohttp.ClientSession, md: wire.AgentMetadata,
                h: XferHandle, head: bytes, doc: bytes) -> None:
    headers = agent.signer.headers("POST", wire.PATH_READ, doc, to=md.name, to_instance=md.instance)
    async with session.post(md.base_url + wire.PATH_READ, data=head, headers=headers,
                            timeout=_client_timeout(agent)) as resp:
        if resp.status != 200:
            await _raise_for_error(resp, md.name)
        if resp.content_length != h.total_bytes:
            raise RemoteError(f"{md.name}: READ response announces {resp.content_length} bytes, "
                              f"expected {h.total_bytes}")
        content = resp.content

        async def readany() -> bytes:
            data = await content.readany()
            h.bytes_done += len(data)
            return data

        await fill_spans(h.local_spans, readany, agent, TruncatedBody)


async def _write(agent: SendingAgent, session: aiohttp.ClientSession, md: wire.AgentMetadata,
                 h: XferHandle, head: bytes, doc: bytes) -> None:
    headers = agent.signer.headers("POST", wire.PATH_WRITE, doc, to=md.name, to_instance=md.instance)
    body = _SpansPayload(head, h.local_spans, agent, h)
    headers["Content-Length"] = str(body.size)
    async with session.post(md.base_url + wire.PATH_WRITE, data=body, headers=headers,
                            timeout=_client_timeout(agent)) as resp:
        if resp.status != 200:
            await _raise_for_error(resp, md.name)
        await resp.read()


async def _small(agent: SendingAgent, method: str, url: str, path: str, body: bytes, peer: str,
                 timeout: float, session: aiohttp.ClientSession | None = None, *,
                 to: tuple[str, str] | None, not_found: str | None = None) -> bytes:
    """A small request/response exchange (notification, metadata, application call), signed for
    the agent ``to`` = (name, instance), or unsigned with ``to=None`` (identity). ``not_found``:
    raise MetadataVersionMismatch with this message on a 404 (a route older peers lack)."""
    sess = session or agent.session
    headers = {} if to is None else agent.signer.headers(method, path, body, to=to[0], to_instance=to[1])

    async def go() -> bytes:
        async with asyncio.timeout(timeout):
            async with sess.request(method, url + path, data=body or None, headers=headers,
                                    timeout=_client_timeout(agent)) as resp:
                if resp.status == 404 and not_found is not None:
                    raise MetadataVersionMismatch(not_found)
                if resp.status != 200:
                    await _raise_for_error(resp, peer)
                return await resp.read()

    return await _mapped(peer, f"{method} {path}", go)


async def send_notif(agent: SendingAgent, md: wire.AgentMetadata, msg: bytes, timeout: float,
                     session: aiohttp.ClientSession | None = None) -> None:
    await _small(agent, "POST", md.base_url, wire.PATH_NOTIF, msg, md.name, timeout, session,
                 to=(md.name, md.instance))


async def call_remote(agent: SendingAgent, md: wire.AgentMetadata, path: str, body: bytes, timeout: float) -> Any:
    reply = await _small(agent, "POST", md.base_url, path, body, md.name, timeout, to=(md.name, md.instance))
    try:
        return orjson.loads(reply)
    except orjson.JSONDecodeError as e:
        raise RemoteError(f"{md.name}: {path} replied with invalid JSON ({e})") from None


async def fetch_metadata(agent: SendingAgent, base_url: str, timeout: float) -> bytes:
    """The metadata of the agent serving at ``base_url``, under one deadline: its identity
    (unsigned), then its metadata, signed for the name and instance the identity gave."""
    url = base_url.rstrip("/")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    ident = await _small(agent, "GET", url, wire.PATH_IDENTITY, b"", base_url, timeout, to=None,
                         not_found=f"{base_url} has no identity route: it runs a protocol older than {PROTOCOL} "
                                   "(upgrade both sides)")
    name, instance = wire.decode_identity(ident, base_url)
    data = await _small(agent, "GET", url, wire.PATH_METADATA, b"", base_url, max(deadline - loop.time(), 0.0),
                        to=(name, instance))
    if not data:
        raise MetadataError(f"{base_url} returned empty metadata")
    md = wire.decode_metadata(data)
    if (md.name, md.instance) != (name, instance):
        raise MetadataError(f"{base_url} answered a metadata request signed for agent {name!r} with the "
                            f"metadata of {md.name!r} or of another incarnation")
    return data
