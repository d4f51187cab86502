"""Server side of the HTTP transport: the aiohttp handlers of an Agent (a ``roles.ServingAgent``).

Every handler follows one order, so that bad input is refused before it can touch memory:

1. cheap auth checks on the headers (signature headers present, addressed to this agent,
   timestamp inside the window);
2. read the length-prefixed descriptor document, bounded by ``max_doc_bytes``;
3. verify the HMAC over method, path, sender, this agent's name and instance and the
   document, then the nonce (replay);
4. parse and type-check the document, check every descriptor against registered memory
   (and against ``writable`` for WRITE) and the body length against the descriptors;
5. only then stream bytes, chunk by chunk, each chunk wait under ``io_timeout_s``.

Errors before the response starts become a JSON error response (``wire.error_body``); an error
after a READ response started streaming can only abort the connection, which the client sees as a
short body. Nothing is buffered beyond one chunk per request.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tract_async.errors import TractError
from tract_async.transport import wire
from tract_async.transport.auth import H_AGENT
from tract_async.transport.descs import Span
from tract_async.transport.errors import (
    CODE_OF,
    AgentClosed,
    MalformedRequest,
    PeerBusy,
    RemoteError,
    RequestTooLarge,
    TransportError,
    TruncatedBody,
)
from tract_async.transport.roles import AgentCore, ServingAgent

# The handlers see the agent only as a ServingAgent (``roles``): this module never imports ``http``.
AGENT_KEY: web.AppKey[ServingAgent] = web.AppKey("tract_agent", "ServingAgent")  # type: ignore[arg-type]

DOC_LEN_KEY = web.RequestKey("tract_doc_len", int)    # length of the request's descriptor document
STARTED_KEY = web.RequestKey("tract_started", bool)   # response bytes are on the wire: abort, don't answer
ADMITTED_KEY = web.RequestKey("tract_admitted", str)  # the peer whose in-flight slot this request holds

COALESCE_BELOW = 64 << 10     # DRAM spans smaller than this are joined into larger response pieces
_READ_HEADERS = {"Content-Type": "application/octet-stream"}

_STATUS = {"auth_failed": 401, "replayed": 401, "wrong_recipient": 401, "too_large": 413, "closed": 503,
           "busy": 429,
           "remote": 500}


def error_response(exc: TransportError) -> web.Response:
    code = CODE_OF.get(type(exc), "remote")
    # A subclass without its own code (e.g. a future one) reports its nearest coded base class.
    for cls in type(exc).__mro__:
        if cls in CODE_OF:
            code = CODE_OF[cls]  # type: ignore[index]
            break
    return web.Response(status=_STATUS.get(code, 400), body=wire.error_body(code, str(exc)),
                        content_type="application/json", headers={wire.H_ERROR: code})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guarded(handler: Handler) -> Handler:
    """Turn TransportError raised before the response started into an error response."""

    async def wrapper(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except TransportError as e:
            request.app[AGENT_KEY].stats["requests_refused"] += 1
            if request.get(STARTED_KEY):
                raise  # bytes already on the wire: aborting the connection is all that is left
            return error_response(e)
        finally:
            _release(request)

    return wrapper


def _admit(agent: ServingAgent, request: web.Request) -> None:
    """Take one of the sender's ``max_inflight_per_peer`` slots, or refuse with PeerBusy (429).

    Called right after the signature is verified, so the identity counted is one the secret
    proves (an unauthenticated client cannot use up another peer's slots), and before any
    descriptor is checked or byte moved. ``guarded`` gives the slot back when the handler ends
    (for a streamed READ: after the last byte)."""
    peer = request.headers.get(H_AGENT, "")
    n = agent.inflight.get(peer, 0)
    limit = agent.config.max_inflight_per_peer
    if n >= limit:
        agent.stats["requests_busy"] += 1
        raise PeerBusy(f"agent {agent.name!r} is already serving {n} requests from {peer!r} (the "
                       f"limit is max_inflight_per_peer={limit}); retry when some have finished")
    agent.inflight[peer] = n + 1
    request[ADMITTED_KEY] = peer


def _release(request: web.Request) -> None:
    peer = request.get(ADMITTED_KEY)
    if peer is None:
        return
    del request[ADMITTED_KEY]
    inflight = request.app[AGENT_KEY].inflight
    left = inflight.get(peer, 1) - 1
    if left > 0:
        inflight[peer] = left
    else:
        inflight.pop(peer, None)


async def _read_doc(agent: ServingAgent, request: web.Request) -> bytes:
    cfg = agent.config
    async with asyncio.timeout(cfg.io_timeout_s):
        try:
            head = await request.content.readexactly(wire.DOC_LEN.size)
            (doc_len,) = wire.DOC_LEN.unpack(head)
            if doc_len > cfg.max_doc_bytes:
                raise RequestTooLarge(f"descriptor document of {doc_len} bytes, the limit is {cfg.max_doc_bytes}")
            return await request.content.readexactly(doc_len)
        except (asyncio.IncompleteReadError, HttpProcessingError, ConnectionError):
            raise TruncatedBody("request body ended inside the descriptor document") from None


async def _authenticated_doc(agent: ServingAgent, request: web.Request) -> wire.TransferDoc:
    if agent.closing:
        raise AgentClosed(f"agent {agent.name!r} is closing")
    agent.verifier.precheck(request.headers)
    doc = await _read_doc(agent, request)
    agent.verifier.verify(request.method, request.path, request.headers, doc)
    _admit(agent, request)
    cfg = agent.config
    td = wire.decode_doc(doc, max_descs=cfg.max_descs, max_total_bytes=cfg.max_request_bytes,
                         max_notif_bytes=cfg.max_notif_bytes)
    request[DOC_LEN_KEY] = len(doc)
    return td


def _hold(spans: list[Span]) -> None:
    for s in spans:
        s.reg.users += 1


def _unhold(spans: list[Span]) -> None:
    for s in spans:
        s.reg.users -= 1


@guarded
async def handle_read(request: web.Request) -> web.StreamResponse:
    """Stream the bytes of the requested descriptors back, in order."""
    agent = request.app[AGENT_KEY]
    td = await _authenticated_doc(agent, request)
    expect = wire.DOC_LEN.size + request[DOC_LEN_KEY]
    if request.content_length is not None and request.content_length != expect:
        raise MalformedRequest(f"a READ body is only its descriptor document ({expect} bytes), "
                               f"got Content-Length {request.content_length}")
    spans = agent.registry.spans(td.rows, td.mem_type, for_write=False, local=False)
    _hold(spans)
    try:
        timeout = agent.config.io_timeout_s
        pieces = None
        if td.mem_type == "DRAM":
            pieces = dram_pieces(spans, agent.config.chunk_bytes)
            first = next(pieces)
            second = next(pieces, None)
        if pieces is not None and second is None:
            # One piece: a Response sends headers and body in one write (a StreamResponse sends its
            # headers on their own, one more syscall and one more wake-up of the reader).
            resp: web.StreamResponse = web.Response(body=first, content_type="application/octet-stream")
            request[STARTED_KEY] = True
            await resp.prepare(request)
            async with asyncio.timeout(timeout):
                await resp.write_eof()   # sent here, while the spans are held
        else:
            if pieces is not None:
                pieces = itertools.chain((first, second), pieces)  # type: ignore[arg-type]
            resp = await _stream_read(request, agent, spans, td.total_bytes, pieces)
    finally:
        _unhold(spans)
    agent.stats["bytes_served"] += td.total_bytes
    agent.stats["reads_served"] += 1
    return resp


async def _stream_read(request: web.Request, agent: ServingAgent, spans: list[Span], total: int,
                       pieces: Iterator[memoryview | bytes] | None) -> web.StreamResponse:
    """A READ response of several pieces (DRAM ``pieces``) or staged through pinned memory (VRAM)."""
    timeout = agent.config.io_timeout_s
    resp = web.StreamResponse(headers=_READ_HEADERS)
    resp.content_length = total
    request[STARTED_KEY] = True
    await resp.prepare(request)
    if pieces is not None:
        for piece in pieces:
            async with asyncio.timeout(timeout):
                await resp.write(piece)
    else:
        chunk = agent.config.chunk_bytes
        for span in spans:
            async for vpiece in span.read_pieces(chunk, agent.staging):
                async with asyncio.timeout(timeout):
                    await resp.write(vpiece)
    await resp.write_eof()
    return resp


def dram_pieces(spans: list[Span], chunk: int) -> Iterator[memoryview | bytes]:
    """The bytes of DRAM spans as few, large pieces: a span of at least ``COALESCE_BELOW`` bytes
    goes out as zero-copy memoryviews of at most ``chunk`` bytes; runs of smaller spans are
    joined (one copy) into pieces of up to ``chunk`` bytes, because each write costs far more
    Python than a copy of a few KiB (scattered KV blocks).
    """
    batch: list[memoryview] = []
    size = 0
    for s in spans:
        mv = s.reg.access[s.offset_bytes:s.offset_bytes + s.nbytes]
        if s.nbytes >= COALESCE_BELOW:
            if batch:
                yield batch[0] if len(batch) == 1 else b"".join(batch)
                batch, size = [], 0
            for pos in range(0, s.nbytes, chunk):
                yield mv[pos:pos + chunk]
            continue
        batch.append(mv)
        size += s.nbytes
        if size >= chunk:
            yield b"".join(batch)
            batch, size = [], 0
    if batch:
        yield batch[0] if len(batch) == 1 else b"".join(batch)


@guarded
async def handle_write(request: web.Request) -> web.StreamResponse:
    """Land the request's payload in the named descriptors, then deliver its notification."""
    agent = request.app[AGENT_KEY]
    td = await _authenticated_doc(agent, request)
    expect = wire.DOC_LEN.size + request[DOC_LEN_KEY] + td.total_bytes
    if request.content_length is None:
        raise MalformedRequest("a WRITE needs a Content-Length (no chunked bodies)")
    if request.content_length < expect:
        raise TruncatedBody(f"WRITE body of {request.content_length} bytes is shorter than the "
                            f"{expect} its descriptors need")
    if request.content_length > expect:
        raise MalformedRequest(f"WRITE body of {request.content_length} bytes is longer than the {expect} "
                               "its descriptors need")
    spans = agent.registry.spans(td.rows, td.mem_type, for_write=True, local=False)
    content = request.content

    async def readany() -> bytes:
        try:
            return await content.readany()
        except (HttpProcessingError, ConnectionError) as e:  # the writer went away mid-body
            raise TruncatedBody(f"WRITE body broke off: {type(e).__name__}: {e}") from None

    _hold(spans)
    try:
        await fill_spans(spans, readany, agent, TruncatedBody)
    finally:
        _unhold(spans)
    if td.notif:
        agent.deliver_notif(request.headers.get(H_AGENT, ""), td.notif)
    agent.stats["bytes_received"] += td.total_bytes
    agent.stats["writes_served"] += 1
    return web.Response(body=b'{"ok":true}', content_type="application/json")


async def fill_spans(spans: list[Span], readany: Callable[[], Awaitable[bytes]], agent: AgentCore,
                     short: type[TransportError]) -> None:
    """Fill ``spans`` in order from a byte stream; shared by the server (WRITE) and client (READ).

    Each read waits under ``io_timeout_s``. Raises ``short`` if the stream ends early; lets
    transport-level exceptions (connection reset, payload errors) propagate to the caller, who
    knows which class describes them.
    """
    timeout = agent.config.io_timeout_s
    pending = memoryview(b"")
    for span in spans:
        w = span.writer(agent.staging)
        try:
            while w.remaining:
                if not pending:
                    async with asyncio.timeout(timeout):
                        data = await readany()
                    if not data:
                        raise short(f"body ended {w.remaining} bytes before the end of a "
                                    f"{span.nbytes}-byte descriptor")
                    pending = memoryview(data)
                take = min(len(pending), w.remaining)
                await w.write(pending[:take])  # a received chunk may straddle two descriptors
                pending = pending[take:]
        finally:
            await w.finish()
    if pending:
        raise MalformedRequest("body is longer than its descriptors")


@guarded
async def handle_notif(request: web.Request) -> web.StreamResponse:
    """A standalone notification (also sent by a reader after its READ completed)."""
    agent = request.app[AGENT_KEY]
    if agent.closing:
        raise AgentClosed(f"agent {agent.name!r} is closing")
    agent.verifier.precheck(request.headers)
    body = await _bounded_body(request, agent.config.max_notif_bytes)
    agent.verifier.verify(request.method, request.path, request.headers, body)
    _admit(agent, request)
    agent.deliver_notif(request.headers.get(H_AGENT, ""), body)
    return web.Response(body=b'{"ok":true}', content_type="application/json")


@guarded
async def handle_metadata(request: web.Request) -> web.StreamResponse:
    """This agent's metadata, for peers that bootstrap from a URL (fetch_remote_metadata)."""
    agent = request.app[AGENT_KEY]
    agent.verifier.verify(request.method, request.path, request.headers, b"")
    return web.Response(body=agent.get_agent_metadata(), content_type="application/octet-stream")


@guarded
async def handle_identity(request: web.Request) -> web.StreamResponse:
    """Unsigned: the protocol, name and instance of this agent, so that a peer holding only a URL
    can sign its metadata fetch for this agent (see ``auth``: what is bound on which route)."""
    agent = request.app[AGENT_KEY]
    if agent.closing:
        raise AgentClosed(f"agent {agent.name!r} is closing")
    return web.Response(body=wire.encode_identity(agent.name, agent.instance), content_type="application/json")


async def _bounded_body(request: web.Request, limit: int) -> bytes:
    """The whole (small) body, refused as soon as it passes ``limit``."""
    if request.content_length is not None and request.content_length > limit:
        raise RequestTooLarge(f"body of {request.content_length} bytes, the limit is {limit}")
    parts: list[bytes] = []
    size = 0
    async with asyncio.timeout(request.app[AGENT_KEY].config.io_timeout_s):
        try:
            while data := await request.content.readany():
                size += len(data)
                if size > limit:
                    raise RequestTooLarge(f"body is over the limit of {limit} bytes")
                parts.append(data)
        except (HttpProcessingError, ConnectionError):
            raise TruncatedBody("request body broke off") from None
    return b"".join(parts)


JsonHandler = Callable[[str, Any], Awaitable[Any]]


def json_route(handler: JsonHandler) -> Handler:
    """Serve an application JSON endpoint behind the transport's authentication.

    The handler runs only for a request signed with the shared secret over its whole body
    (bounded by ``max_app_body_bytes``); it gets the sender's agent name and the decoded JSON
    and returns something orjson can encode. A TransportError it raises reaches the caller as the
    same class; any other TractError as RemoteError with its message.
    """

    @guarded
    async def wrapper(request: web.Request) -> web.StreamResponse:
        agent = request.app[AGENT_KEY]
        if agent.closing:
            raise AgentClosed(f"agent {agent.name!r} is closing")
        agent.verifier.precheck(request.headers)
        body = await _bounded_body(request, agent.config.max_app_body_bytes)
        agent.verifier.verify(request.method, request.path, request.headers, body)
        _admit(agent, request)
        try:
            payload = orjson.loads(body) if body else None
        except orjson.JSONDecodeError as e:
            raise MalformedRequest(f"application body is not JSON: {e}") from None
        try:
            result = await handler(request.headers.get(H_AGENT, ""), payload)
        except TransportError:
            raise
        except TractError as e:
            raise RemoteError(f"{type(e).__name__}: {e}") from None
        return web.Response(body=orjson.dumps(result), content_type="application/json")

    return wrapper
