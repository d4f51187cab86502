"""Hypothesis fuzz of the agent's request handling, against a live server.

Requests are generated at three depths: raw bytes (framing), a well-framed but arbitrary JSON
document, and a typed document with descriptors aimed near the registered ranges; each either
signed with the right secret (so parsing past authentication is fuzzed too) or not. Properties:
every answer is 200 or a 4xx with an error code (never a 5xx), the read-only export never
changes, and the server still serves a good READ at the end. The server runs on its own event
loop in a thread because hypothesis drives plain (synchronous) test functions. Bounded to well
under a minute (max_examples, deadline-free).
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tract_async.transport import wire
from tract_async.transport.auth import Signer
from tract_async.transport.http import Agent

SECRET = b"fuzz-secret-0123456789abcdef"
pytestmark = pytest.mark.timeout(120)


class LiveServer:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.kv = torch.arange(1 << 14, dtype=torch.int32)      # 64 KiB read-only export
        self.inbox = torch.zeros(1 << 14, dtype=torch.uint8)    # 16 KiB writable
        self.agent = Agent("srv", secret=SECRET, max_request_bytes=1 << 20, max_descs=32,
                           max_doc_bytes=1 << 14, io_timeout_s=5.0)
        self.kv_info = self.agent.register_memory(self.kv, name="kv", writable=False)
        self.inbox_info = self.agent.register_memory(self.inbox, name="inbox")
        self.run(self.agent.start())
        self.session: aiohttp.ClientSession = self.run(self._session())
        self.url = f"http://127.0.0.1:{self.agent.port}"
        self.signer = Signer("fuzzer", SECRET)

    def signed(self, path: str, doc: bytes) -> dict[str, str]:
        """Auth headers of a POST of ``path`` signed for the live agent."""
        return self.signer.headers("POST", path, doc, to=self.agent.name, to_instance=self.agent.instance)

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def run(self, coro):  # noqa: ANN001, ANN201 - test plumbing
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
        async with self.session.post(self.url + path, data=body, headers=headers) as r:
            await r.read()
            return r.status, r.headers.get(wire.H_ERROR, "")

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
        return self.run(self._post(path, body, headers))

    def close(self) -> None:
        self.run(self.session.close())
        self.run(self.agent.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    srv = LiveServer()
    try:
        yield srv
    finally:
        srv.close()


def _near(live: LiveServer) -> st.SearchStrategy[int]:
    k, i = live.kv_info, live.inbox_info
    anchors = [0, 1, k.addr, k.addr + k.nbytes, i.addr, i.addr + i.nbytes, (1 << 63) - 1]
    return st.one_of(st.sampled_from(anchors),
                     st.builds(lambda a, d: max(a + d, 0), st.sampled_from(anchors), st.integers(-70000, 70000)))


def _doc(live: LiveServer) -> st.SearchStrategy[bytes]:
    json_any = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False)
                            | st.text(max_size=8), lambda c: st.lists(c, max_size=4)
                            | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)
    row = st.one_of(st.lists(st.one_of(_near(live), st.integers(0, 70000), st.integers(0, 2)), min_size=3, max_size=3),
                    json_any)
    typed = st.fixed_dictionaries(
        {"mem_type": st.sampled_from(["DRAM", "VRAM", "HBM", 1]),
         "descs": st.one_of(st.lists(row, min_size=0, max_size=6), json_any),
         "notif": st.one_of(st.sampled_from(["", "aGk=", "%%", "A" * 10]), json_any)})
    return st.one_of(typed.map(orjson.dumps), json_any.map(orjson.dumps), st.binary(max_size=64))


@st.composite
def requests(draw: st.DrawFn, live: LiveServer) -> tuple[str, bytes, dict[str, str]]:
    path = draw(st.sampled_from([wire.PATH_READ, wire.PATH_WRITE, wire.PATH_NOTIF]))
    doc = draw(_doc(live))
    shape = draw(st.sampled_from(["framed", "framed+payload", "bad-length", "raw"]))
    if shape == "raw":
        body = draw(st.binary(max_size=256))
    else:
        n = len(doc) if shape != "bad-length" else draw(st.integers(0, (1 << 32) - 1))
        body = wire.DOC_LEN.pack(n) + doc
        if shape == "framed+payload":
            body += draw(st.binary(max_size=4096))
    signed_over = body if path == wire.PATH_NOTIF else doc
    headers = live.signed(path, signed_over) if draw(st.booleans()) else {}
    return path, body, headers


def test_fuzz_request_handling(live: LiveServer) -> None:
    kv_digest = hashlib.sha256(live.kv.numpy().tobytes()).hexdigest()

    @settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(req=requests(live))
    def one(req: tuple[str, bytes, dict[str, str]]) -> None:
        path, body, headers = req
        status, code = live.post(path, body, headers)
        assert status == 200 or (400 <= status < 500 and code), (status, code)

    one()
    assert hashlib.sha256(live.kv.numpy().tobytes()).hexdigest() == kv_digest
    # Still serving: a good signed READ returns the export's bytes.
    doc = wire.encode_doc([list(live.kv_info.desc(0, 4096))], "DRAM", b"")

    async def good_read() -> bytes:
        async with live.session.post(live.url + wire.PATH_READ, data=wire.DOC_LEN.pack(len(doc)) + doc,
                                     headers=live.signed(wire.PATH_READ, doc)) as r:
            assert r.status == 200
            return await r.read()

    assert live.run(good_read()) == live.kv.numpy().tobytes()[:4096]
