"""Replays across agents: a signed request captured on its way to one agent is refused by every other.

A rack shares one secret and each agent remembers only the nonces it has seen itself, so only the
recipient bound into the signature (name and instance, see ``transport.auth``) keeps a request
addressed to agent A from being accepted by agent B, or by a restarted A.

The capture is real: a TCP relay (``Tap``) sits in front of A, the sender's metadata for A
points at the relay, and the relay keeps every byte the sender wrote. A captured request is then
written, byte for byte, to B's port. In the transport tests A and B export the very same memory,
so B's descriptor check passes and authentication is all that stands between the replay and B.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
import torch

import tract_async as tract
from tract_async.stores.http import ROUTE_ANNOUNCE, ROUTE_CHECK, ROUTE_HELLO
from tract_async.transport import auth, wire
from tract_async.transport import errors as E
from tract_async.transport.http import Agent
from tests.support.engine_http_util import http_cfg
from tests.support.engine_util import kv_for_keys

SECRET = b"replay-secret-0123456789abcdef"
APP_ROUTES = (ROUTE_HELLO, ROUTE_ANNOUNCE, ROUTE_CHECK)
pytestmark = pytest.mark.timeout(60)


class Tap:
    """A TCP relay to ``127.0.0.1:target_port`` that keeps what its clients sent, per connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent: list[bytearray] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _relay(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        log = bytearray()
        self.sent.append(log)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bytearray | None) -> None:
            try:
                while data := await src.read(1 << 16):
                    if keep is not None:
                        keep += data
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        for t in (asyncio.create_task(pump(down_r, up_w, log)), asyncio.create_task(pump(up_r, down_w, None))):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def requests(self, path: str) -> list[bytes]:
        """Every complete request to ``path`` the clients sent, as raw bytes, in order."""
        out = []
        for log in self.sent:
            pos = 0
            while (end := log.find(b"\r\n\r\n", pos)) >= 0:
                head = bytes(log[pos:end]).decode("latin-1").split("\r\n")
                length = 0
                for line in head[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                raw = bytes(log[pos:end + 4 + length])
                if head[0].split(" ")[1] == path:
                    out.append(raw)
                pos = end + 4 + length
        return out

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        if self._server is not None:
            await self._server.wait_closed()


async def replay(port: int, raw: bytes) -> tuple[int, str, bytes]:
    """Write ``raw`` to 127.0.0.1:``port``; the response's status, X-Tract-Error and body."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(raw)
        await w.drain()
        async with asyncio.timeout(10):
            head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await r.readexactly(int(headers.get("content-length", "0")))
        return int(head[0].split(" ")[1]), headers.get(wire.H_ERROR.lower(), ""), body
    finally:
        w.close()


def readdress(raw: bytes, name: str, instance: str) -> bytes:
    """``raw`` with its recipient headers rewritten (what an attacker can do without the secret)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    head = re.sub(rb"(?im)^X-Tract-To:[^\r\n]*", f"X-Tract-To: {name}".encode(), head)
    head = re.sub(rb"(?im)^X-Tract-To-Instance:[^\r\n]*", f"X-Tract-To-Instance: {instance}".encode(), head)
    return head + sep + body


def via(md: bytes, port: int) -> bytes:
    """``md`` with its port replaced: the sender then dials ``port`` (a Tap) for that agent."""
    return wire.encode_metadata(dataclasses.replace(wire.decode_metadata(md), port=port))


def message(body: bytes) -> str:
    return str(orjson.loads(body).get("message"))


# --- every route of the transport, and the application routes --------------------------------------
@dataclasses.dataclass
class Rack:
    a: Agent
    b: Agent
    s: Agent                       # the sender; it knows A only through the tap
    tap: Tap
    kv: torch.Tensor               # exported read-only by A and by B
    inbox: torch.Tensor            # exported writable by A and by B
    dst: torch.Tensor
    src: torch.Tensor
    calls: dict[str, list[tuple[str, str, Any]]]   # agent -> (route, sender, payload) it served


def _recorder(calls: list[tuple[str, str, Any]], path: str) -> Callable[[str, Any], Awaitable[Any]]:
    async def handler(sender: str, payload: Any) -> Any:
        calls.append((path, sender, payload))
        return {"ok": True}

    return handler


@pytest.fixture
async def rack() -> AsyncIterator[Rack]:
    kv = torch.arange(1 << 12, dtype=torch.int32)
    inbox = torch.zeros(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    src = torch.full((4096,), 7, dtype=torch.uint8)
    a, b, s = Agent("a", secret=SECRET), Agent("b", secret=SECRET), Agent("s", secret=SECRET)
    calls: dict[str, list[tuple[str, str, Any]]] = {"a": [], "b": []}
    for ag in (a, b):
        ag.register_memory(kv, name="kv", writable=False)
        ag.register_memory(inbox, name="inbox")
        for path in APP_ROUTES:
            ag.add_json_route(path, _recorder(calls[ag.name], path))
    s.register_memory(dst, name="dst")
    s.register_memory(src, name="src")
    tap = Tap(0)
    try:
        for ag in (a, b, s):
            await ag.start()
        tap.target_port = a.port
        await tap.start()
        assert await s.fetch_remote_metadata(tap.url, timeout=10) == "a"   # the metadata GET, captured
        s.add_remote_agent(via(a.get_agent_metadata(), tap.port))          # from now on all of s -> a
        s.add_remote_agent(b.get_agent_metadata())                         # s knows b too, as in a rack
        yield Rack(a=a, b=b, s=s, tap=tap, kv=kv, inbox=inbox, dst=dst, src=src, calls=calls)
    finally:
        await tap.close()
        for ag in (s, b, a):
            await ag.close()


async def _send_to_a(r: Rack, route: str) -> str:
    """One real request of ``route`` from s to a (through the tap); checks a served it; its path."""
    s, a = r.s, r.a
    if route == "read":
        h = s.initialize_xfer("READ", s.get_xfer_descs([s.registry.get("dst").desc(0, 4096)]),
                              s.get_xfer_descs([s.remote_region("a", "kv").desc(0, 4096)]), "a", b"read-done")
        await s.transfer(h, timeout=10)
        h.release()
        assert r.dst.numpy().tobytes() == r.kv.numpy().tobytes()[:4096]
        assert a.get_new_notifs() == {"s": [b"read-done"]} and a.stats["reads_served"] == 1
        return wire.PATH_READ
    if route == "write":
        h = s.initialize_xfer("WRITE", s.get_xfer_descs([s.registry.get("src").desc()]),
                              s.get_xfer_descs([s.remote_region("a", "inbox").desc()]), "a", b"write-done")
        await s.transfer(h, timeout=10)
        h.release()
        assert (r.inbox == 7).all()
        assert a.get_new_notifs() == {"s": [b"write-done"]} and a.stats["writes_served"] == 1
        r.inbox.zero_()   # so a replayed WRITE that lands would show
        return wire.PATH_WRITE
    if route == "notif":
        await s.send_notif("a", b"ping")
        assert a.get_new_notifs() == {"s": [b"ping"]}
        return wire.PATH_NOTIF
    if route == "metadata":
        return wire.PATH_METADATA   # sent by the fixture (s fetched a's metadata through the tap)
    await s.call("a", route, {"route": route}, timeout=10)
    assert r.calls["a"] == [(route, "s", {"route": route})]
    return route


@pytest.mark.parametrize("route", ["read", "write", "notif", "metadata", *APP_ROUTES])
async def test_request_signed_for_one_agent_is_refused_by_another(rack: Rack, route: str) -> None:
    path = await _send_to_a(rack, route)
    captured = rack.tap.requests(path)
    assert len(captured) == 1, f"expected one {path} request on its way to a, saw {len(captured)}"
    raw = captured[0]
    b = rack.b
    status, code, body = await replay(b.port, raw)
    assert (status, code) == (401, "wrong_recipient"), (status, code, body[:200])
    msg = message(body)
    assert "'a'" in msg and "'b'" in msg, msg            # says whom it was for and who refused it
    assert SECRET.decode() not in msg
    # The recipient headers only make the message clear; the signature is what binds. Rewritten
    # to name b, the request gets past the header check and fails on the signature.
    status, code, body = await replay(b.port, readdress(raw, "b", b.instance))
    assert (status, code) == (401, "auth_failed") and "signature" in message(body), (status, code, body[:200])
    # b did nothing: no bytes served or landed, no notification, no handler ran.
    assert b.get_new_notifs() == {}
    assert rack.calls["b"] == []
    assert b.stats["reads_served"] == 0 and b.stats["writes_served"] == 0
    assert b.stats["requests_refused"] == 2
    assert not rack.inbox.any()
    # Control: the captured bytes are a genuine signed request; a refuses them only as a replay.
    assert (await replay(rack.a.port, raw))[:2] == (401, "replayed")
    assert rack.a.get_new_notifs() == {}


async def test_restarted_agent_refuses_requests_signed_for_its_previous_incarnation() -> None:
    s, a1 = Agent("s", secret=SECRET), Agent("a", secret=SECRET)
    tap = Tap(0)
    a2: Agent | None = None
    try:
        await s.start()
        await a1.start()
        tap.target_port = a1.port
        await tap.start()
        s.add_remote_agent(via(a1.get_agent_metadata(), tap.port))
        await s.send_notif("a", b"hi")
        assert a1.get_new_notifs() == {"s": [b"hi"]}
        (raw,) = tap.requests(wire.PATH_NOTIF)
        old_md = a1.get_agent_metadata()
        await a1.close()
        a2 = Agent("a", secret=SECRET)   # same name, new incarnation, empty nonce cache
        await a2.start()
        status, code, body = await replay(a2.port, raw)
        assert (status, code) == (401, "wrong_recipient"), (status, code, body[:200])
        status, code, body = await replay(a2.port, readdress(raw, "a", a2.instance))
        assert (status, code) == (401, "auth_failed"), (status, code, body[:200])
        assert a2.get_new_notifs() == {}
        # A sender still holding the old incarnation's metadata learns what to do.
        s.add_remote_agent(via(old_md, a2.port))
        with pytest.raises(E.WrongRecipient, match="restarted"):
            await s.send_notif("a", b"stale")
        await s.fetch_remote_metadata(f"http://127.0.0.1:{a2.port}", timeout=10)
        await s.send_notif("a", b"fresh")
        assert a2.get_new_notifs() == {"s": [b"fresh"]}
    finally:
        await tap.close()
        for ag in (a2, a1, s):
            if ag is not None:
                await ag.close()


async def test_request_of_the_previous_protocol_version_is_refused_clearly() -> None:
    """A tract-http-v1 request (no recipient bound) to this version: refused, saying why."""
    async with Agent("a", secret=SECRET) as a:
        ts, nonce, body = f"{time.time():.6f}", os.urandom(16).hex(), b"v1 notification"
        v1 = b"\n".join((b"tract-http-v1", b"POST", wire.PATH_NOTIF.encode(), b"old", ts.encode(),
                         nonce.encode(), hashlib.sha256(body).hexdigest().encode()))
        headers = {auth.H_AGENT: "old", auth.H_TIME: ts, auth.H_NONCE: nonce,
                   auth.H_SIG: hmac.new(SECRET, v1, hashlib.sha256).hexdigest()}
        raw = (f"POST {wire.PATH_NOTIF} HTTP/1.1\r\nHost: 127.0.0.1:{a.port}\r\nContent-Length: {len(body)}\r\n"
               + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + body
        status, code, reply = await replay(a.port, raw)
        assert (status, code) == (401, "auth_failed")
        assert "tract-http-v2" in message(reply), message(reply)
        assert a.get_new_notifs() == {}


async def test_identity_route_is_unsigned_and_tells_only_whom_to_sign_for() -> None:
    async with Agent("a", secret=SECRET) as a:
        status, code, body = await replay(
            a.port, f"GET {wire.PATH_IDENTITY} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        assert (status, code) == (200, "")
        assert orjson.loads(body) == {"protocol": "tract-http-v2", "name": "a", "instance": a.instance}


async def test_fetching_metadata_from_an_older_agent_says_so() -> None:
    """An agent of tract-http-v1 has no identity route: the fetch fails naming the versions."""
    from aiohttp import web

    async def v1_metadata(request: web.Request) -> web.Response:
        return web.Response(body=b"TRACTMD\x00\x01\x00{}")

    app = web.Application()
    app.router.add_get(wire.PATH_METADATA, v1_metadata)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        async with Agent("s", secret=SECRET) as s:
            with pytest.raises(E.MetadataVersionMismatch, match="older than tract-http-v2"):
                await s.fetch_remote_metadata(f"http://127.0.0.1:{runner.addresses[0][1]}", timeout=10)
    finally:
        await runner.cleanup()


# --- the engine's own routes, with their real handlers ---------------------------------------------
@pytest.mark.parametrize("route", APP_ROUTES)
async def test_engine_route_signed_for_one_engine_is_refused_by_another(route: str) -> None:
    a = await tract.Engine.open(http_cfg(0))
    b = await tract.Engine.open(http_cfg(1))
    s = await tract.Engine.open(http_cfg(2, peers=[a.url, b.url]))   # s peers with both
    tap = Tap(a._store.agent.port)
    try:
        await tap.start()
        sa, name_a = s._store.agent, a._store.agent.name
        sa.add_remote_agent(via(a._store.agent.get_agent_metadata(), tap.port))
        if route == ROUTE_HELLO:
            await sa.call(name_a, ROUTE_HELLO, s._store._hello_payload(), timeout=10)
        elif route == ROUTE_ANNOUNCE:
            keys = s.block_keys(range(32))
            await s.put_kv(keys, kv_for_keys(keys))      # announced to a (tapped) and to b
            assert a.lookup(keys) == 2 and b.lookup(keys) == 2
        else:
            keys = a.block_keys(range(1000, 1032))
            await a.put_kv(keys, kv_for_keys(keys))
            assert torch.equal(await s.get_kv(keys), kv_for_keys(keys))   # READ + check at a
        (raw,) = tap.requests(route)
        st = b._store

        def state() -> tuple[Any, ...]:
            """What a replayed hello, announce or check could change at b."""
            stats = {k: v for k, v in b.stats().items() if k != "uptime_s"}
            return {k: dict(v) for k, v in st.directory.items()}, dict(st.peers), st.pool.items(), stats

        before = state()
        status, code, body = await replay(st.agent.port, raw)
        assert (status, code) == (401, "wrong_recipient"), (status, code, body[:200])
        status, code, body = await replay(st.agent.port, readdress(raw, st.agent.name, st.agent.instance))
        assert (status, code) == (401, "auth_failed"), (status, code, body[:200])
        assert state() == before
    finally:
        await tap.close()
        for eng in (s, b, a):
            await eng.close()
