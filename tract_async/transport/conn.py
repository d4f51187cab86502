"""The READ data path of the client: HTTP/1.1 over ``asyncio.BufferedProtocol``, straight into memory.

Why not aiohttp's client here: measured on a 2-core VM (``bench/transport.py``), aiohttp's
client spent ~100 µs of Python per request in request/response machinery, and its
``Protocol.data_received`` design costs three user-space copies of every body byte (the event
loop's read buffer into a fresh ``bytes``, the HTTP parser's body slice into another ``bytes``,
and ours into the destination) plus two heap allocations per ~256 KB read, which glibc serves
with ``brk`` growth and page faults each time. That capped a 2 MiB READ at ~0.9 GB/s.

Here the kernel copies the body directly into the destination memoryview (``get_buffer`` hands
out the remaining slice of the current descriptor), so a READ costs one kernel copy and no
allocation per read. The server is still the agent's aiohttp server; requests and responses are
plain HTTP/1.1 with a Content-Length, kept alive and pooled per peer. The response head is
parsed strictly and bounded (``HEAD_BYTES``); anything unexpected closes the connection.

Honest cancellation: bytes only land from event-loop read callbacks; ``_Conn.abort`` (run on
every error, timeout and cancellation) closes the transport and switches ``get_buffer`` to a
scratch buffer first, so once the transfer task has finished no byte can land in the destination.

Only DRAM destinations take this path (VRAM needs the staging copies of ``SpanWriter``, which
the aiohttp path does); control requests (notifications, metadata, routes) stay on aiohttp.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Protocol

import orjson

from tract_async.transport.descs import Span
from tract_async.transport.errors import (
    ERROR_CODES,
    PeerDisconnected,
    PeerUnreachable,
    RemoteError,
    TransferTimeout,
    TransportConfigError,
)

HEAD_BYTES = 64 << 10       # bound on a response head (status line + headers)
ERR_BODY_BYTES = 64 << 10   # bound on an error response body we read
SCATTER_BYTES = 256 << 10   # reads land in a scratch buffer and are scattered when spans are small
DIRECT_MIN = 64 << 10       # a span remainder at least this large is read into directly

_IDLE, _HEAD, _BODY, _ERRBODY, _DEAD = range(5)


class Progress(Protocol):
    """What a READ reports the bytes it landed to (an ``xfer.XferHandle``). A Protocol, so that
    this module stays below ``xfer``, which uses it (issue 16: no import back)."""

    bytes_done: int


class _Response:
    __slots__ = ("status", "headers", "length", "keep_alive")

    def __init__(self, status: int, headers: dict[str, str], length: int | None, keep_alive: bool) -> None:
        self.status, self.headers, self.length, self.keep_alive = status, headers, length, keep_alive


class _ProtocolError(Exception):
    """The peer sent something that is not the HTTP/1.1 response we asked for."""


def _parse_head(raw: bytes) -> _Response:
    """Status line and headers (no trailing CRLFCRLF). Raises _ProtocolError."""
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise _ProtocolError(f"bad status line {lines[0][:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise _ProtocolError(f"bad header line {line[:80]!r}")
        key = name.decode("latin-1").lower()
        val = value.strip().decode("latin-1")
        if key == "content-length" and key in headers and headers[key] != val:
            raise _ProtocolError("conflicting Content-Length headers")
        headers[key] = val
    length = None
    if "transfer-encoding" in headers:
        length = None   # only error bodies may come without a length; see _Conn._on_head
    elif "content-length" in headers:
        cl = headers["content-length"]
        if not cl.isdigit() or len(cl) > 19:
            raise _ProtocolError(f"bad Content-Length {cl[:40]!r}")
        length = int(cl)
    keep_alive = parts[0] == b"HTTP/1.1" and headers.get("connection", "").lower() != "close"
    return _Response(status, headers, length, keep_alive)


class _Conn(asyncio.BufferedProtocol):
    """One pooled connection; serves one READ at a time (no pipelining)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._head = bytearray(HEAD_BYTES)
        self._head_mv = memoryview(self._head)
        self._scratch: memoryview | None = None
        self._state = _IDLE
        self._fill = 0               # bytes in _head (HEAD state) or of the error body (ERRBODY)
        self._fut: asyncio.Future[_Response] | None = None
        self._resp: _Response | None = None
        self._targets: list[memoryview] = []
        self._ti = 0                 # current target
        self._tpos = 0               # position in the current target
        self._left = 0               # body bytes still expected
        self._handle: Progress | None = None
        self._got = 0                # response bytes seen since the request was sent (any state)
        self._watchdog: asyncio.TimerHandle | None = None
        self._seen_at_check = -1

    # --- asyncio.BufferedProtocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one write
            except OSError:
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        state, self._state = self._state, _DEAD
        if state in (_HEAD, _BODY, _ERRBODY):
            self._fail(ConnectionResetError(f"connection closed by the peer ({exc or 'EOF'})"))

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        st = self._state
        if st == _BODY:
            target = self._targets[self._ti]
            rest = len(target) - self._tpos
            if rest >= DIRECT_MIN or rest == self._left:
                return target[self._tpos:]
            return self._scratch_buf()[:min(self._left, SCATTER_BYTES)]
        if st == _HEAD:
            return self._head_mv[self._fill:]   # never full: buffer_updated refuses a full head
        if st == _ERRBODY:
            return self._head_mv[self._fill:self._left]
        # Not expecting bytes (or over a bound): land them in scratch; buffer_updated refuses them.
        return self._scratch_buf()

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        st = self._state
        if st == _BODY:
            target = self._targets[self._ti]
            if len(target) - self._tpos >= DIRECT_MIN or len(target) - self._tpos == self._left:
                self._advance(nbytes)
            else:
                self._scatter(self._scratch_buf()[:nbytes])
            return
        if st == _HEAD:
            self._fill += nbytes
            end = self._head.find(b"\r\n\r\n", max(0, self._fill - nbytes - 3), self._fill)
            if end < 0:
                if self._fill >= HEAD_BYTES:
                    self._protocol_error(f"response head is over {HEAD_BYTES} bytes")
                return
            try:
                resp = _parse_head(bytes(self._head_mv[:end]))
            except _ProtocolError as e:
                self._protocol_error(str(e))
                return
            self._on_head(resp, self._head_mv[end + 4:self._fill])
            return
        if st == _ERRBODY:
            self._fill += nbytes
            if self._fill >= self._left:
                self._finish()
            return
        self._protocol_error("the peer sent bytes while no request was pending")

    # --- the exchange -----------------------------------------------------------------------------
    def _scratch_buf(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(SCATTER_BYTES))
        return self._scratch

    def _on_head(self, resp: _Response, extra: memoryview) -> None:
        self._resp = resp
        if resp.status == 200:
            if resp.length is None or resp.length != self._left:
                self._protocol_error(f"READ response announces {resp.length} bytes, expected {self._left}",
                                     remote=True)
                return
            self._state = _BODY
            if len(extra) > resp.length:
                self._protocol_error("response is longer than its Content-Length")
                return
            if extra:
                self._scatter(extra)
            elif self._left == 0:
                self._finish()
            return
        # An error response: keep its (bounded) body in _head for the message.
        if resp.length is None or resp.length > ERR_BODY_BYTES:
            resp.keep_alive = False   # body unread: the connection cannot be reused
            self._fill = 0
            self._finish()
            return
        if len(extra) > resp.length:
            self._protocol_error("response is longer than its Content-Length")
            return
        self._head_mv[:len(extra)] = extra
        self._fill, self._left, self._state = len(extra), resp.length, _ERRBODY
        if self._fill >= self._left:
            self._finish()

    def _advance(self, n: int) -> None:
        """``n`` bytes landed directly in the current target."""
        self._tpos += n
        self._left -= n
        if self._handle is not None:
            self._handle.bytes_done += n
        if self._tpos == len(self._targets[self._ti]):
            self._ti += 1
            self._tpos = 0
        if self._left == 0:
            self._finish()

    def _scatter(self, data: memoryview) -> None:
        """Copy received bytes into the targets in order (they may straddle descriptors)."""
        if len(data) > self._left:
            self._protocol_error("response is longer than its Content-Length")
            return
        while data:
            target = self._targets[self._ti]
            take = min(len(data), len(target) - self._tpos)
            target[self._tpos:self._tpos + take] = data[:take]
            data = data[take:]
            self._advance(take)

    def _finish(self) -> None:
        self._state = _IDLE
        self._targets = []   # hold no view of registered memory between requests
        self._stop_watchdog()
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            assert self._resp is not None
            fut.set_result(self._resp)

    def _fail(self, exc: BaseException) -> None:
        self._stop_watchdog()
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _protocol_error(self, msg: str, *, remote: bool = False) -> None:
        self.abort()
        self._fail((RemoteError if remote else _ProtocolError)(msg))

    def abort(self) -> None:
        """Stop everything: no byte lands in a target after this returns."""
        self._state = _DEAD
        self._targets = []
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # --- watchdog: io_timeout without progress ----------------------------------------------------
    def _start_watchdog(self, io_timeout: float) -> None:
        self._seen_at_check = -1
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(io_timeout, self._check_progress, io_timeout)

    def _check_progress(self, io_timeout: float) -> None:
        self._watchdog = None
        if self._fut is None or self._fut.done():
            return
        if self._got == self._seen_at_check:
            self._fail(TimeoutError(f"no data for {io_timeout:g} s"))
            return
        self._seen_at_check = self._got
        self._watchdog = asyncio.get_running_loop().call_later(io_timeout, self._check_progress, io_timeout)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def send(self, request: bytes, spans: list[Span], total: int, handle: Progress | None,
             io_timeout: float) -> asyncio.Future[_Response]:
        """Write ``request``; the future resolves with the response once its body is in ``spans``
        (status 200) or in the error buffer (other statuses)."""
        assert self._state == _IDLE and self.transport is not None
        fut: asyncio.Future[_Response] = asyncio.get_running_loop().create_future()
        self._fut, self._resp, self._handle = fut, None, handle
        self._targets = [s.reg.access[s.offset_bytes:s.offset_bytes + s.nbytes] for s in spans]
        self._ti = self._tpos = self._fill = self._got = 0
        self._left = total
        self._state = _HEAD
        self._start_watchdog(io_timeout)
        self.transport.write(request)
        return fut

    def error_body(self) -> bytes:
        return bytes(self._head_mv[:self._fill])


class ReadPool:
    """Keep-alive ``_Conn`` connections per peer address, at most ``limit`` per peer."""

    def __init__(self, limit: int, connect_timeout: float) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._sems: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._limit = limit
        self._connect_timeout = connect_timeout
        self._closed = False

    async def _connect(self, key: tuple[str, int], peer: str) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(_Conn, key[0], key[1])
        except TimeoutError as e:
            raise TransferTimeout(f"READ: cannot connect to {peer!r} within {self._connect_timeout:g} s") from e
        except OSError as e:
            raise PeerUnreachable(f"READ: cannot connect to {peer!r} ({e})") from e
        return conn

    async def read(self, host: str, port: int, peer: str, request: bytes, spans: list[Span], total: int,
                   handle: Progress | None, io_timeout: float) -> tuple[_Response, bytes]:
        """One request/response on a pooled connection; returns the response and, for a non-200
        status, its body. A reused connection that the peer closed before answering (its
        keep-alive ran out) is retried once on a fresh one: a READ changes nothing remotely.

        Raises PeerUnreachable, PeerDisconnected, TransferTimeout, RemoteError.
        """
        if self._closed:
            raise PeerDisconnected("the agent's connection pool is closed")
        key = (host, port)
        sem = self._sems.get(key)
        if sem is None:
            sem = self._sems[key] = asyncio.Semaphore(self._limit)
        async with sem:
            for attempt in (0, 1):
                idle = self._idle.get(key)
                conn = None
                while idle:
                    c = idle.pop()
                    if not c.closed:
                        conn = c
                        break
                if conn is None:
                    conn = await self._connect(key, peer)
                try:
                    resp = await conn.send(request, spans, total, handle, io_timeout)
                except ConnectionResetError as e:
                    conn.abort()
                    if attempt == 0 and conn.reused and conn._got == 0:
                        continue   # stale keep-alive connection: nothing was answered, try a fresh one
                    raise PeerDisconnected(f"READ: {peer!r} went away mid-transfer ({e})") from e
                except TimeoutError as e:
                    conn.abort()
                    raise TransferTimeout(f"READ with {peer!r}: peer stalled ({e})") from e
                except _ProtocolError as e:
                    conn.abort()
                    raise PeerDisconnected(f"READ: {peer!r} sent an invalid response ({e})") from e
                except RemoteError as e:
                    conn.abort()
                    raise RemoteError(f"{peer}: {e}") from None
                except BaseException:
                    conn.abort()   # cancelled or failed mid-body: nothing more may land
                    raise
                err = conn.error_body() if resp.status != 200 else b""
                if resp.keep_alive and not conn.closed and not self._closed:
                    conn.reused = True
                    self._idle.setdefault(key, []).append(conn)
                else:
                    conn.abort()
                return resp, err
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for c in conns:
                c.abort()
        self._idle.clear()


def build_request(path: str, host: str, headers: dict[str, str], body: bytes) -> bytes:
    """An HTTP/1.1 POST with a Content-Length (``host`` is the Host header, "h:port"). Raises
    TransportConfigError on a header value with a line break (it would split the request)."""
    lines = [f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
             f"Content-Length: {len(body)}\r\n"]
    for k, v in headers.items():
        if "\r" in v or "\n" in v:
            raise TransportConfigError(f"header {k} contains a line break")
        lines.append(f"{k}: {v}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode() + body


def raise_for_error(resp: _Response, body: bytes, peer: str) -> None:
    """Map an error response to the exception class its code names (as ``xfer._raise_for_error``)."""
    code = resp.headers.get("x-tract-error", "")
    try:
        msg = str(orjson.loads(body).get("message"))
    except (orjson.JSONDecodeError, AttributeError):
        msg = f"HTTP {resp.status}"
    raise ERROR_CODES.get(code, RemoteError)(f"{peer}: {msg}")
