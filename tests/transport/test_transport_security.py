"""Security properties of the HTTP agent that no other transport test pins down.

* The shared secret never leaves the process in any form an operator might paste into a ticket:
  not in a log record (DEBUG and up, every logger), an exception message, an HTTP error body or
  header, nor the published metadata -- neither as bytes nor as hex or base64 -- while a real
  agent pair is provoked with every authentication failure the server knows.
* A per-peer limit on requests served at once (``max_inflight_per_peer``): one authenticated
  peer cannot occupy every handler of an agent; the excess gets 429 and ``PeerBusy``, other
  peers are unaffected, and slots come back when requests finish.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time

import aiohttp
import pytest
import torch

from tract_async.transport import auth, wire
from tract_async.transport import errors as E
from tract_async.transport.http import Agent

SECRET = b"s3cr3t-never-logged-0123456789ab"
OTHER = b"0ther-secret-also-private-987654"
pytestmark = pytest.mark.timeout(60)


def _forms(secret: bytes) -> list[str]:
    """Every spelling of ``secret`` that could end up in text."""
    return [secret.decode("latin-1"), secret.hex(), secret.hex().upper(),
            base64.b64encode(secret).decode(), base64.urlsafe_b64encode(secret).decode(),
            base64.b64encode(secret).decode().rstrip("="), repr(secret), str(list(secret))]


async def _raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, str]:
    """POST without the client library's checks: (status, error header, whole response text)."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=body, headers=headers) as r:
            text = (await r.read()).decode("latin-1")
            return r.status, r.headers.get(wire.H_ERROR, ""), text + repr(dict(r.headers))


async def test_secret_never_in_logs_errors_or_bodies(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)          # the root logger: every library's records
    seen: list[str] = []                     # every exception and response text produced

    def keep(exc: BaseException) -> None:
        seen.extend([str(exc), repr(exc), repr(exc.args)])

    srv = Agent("srv", secret=SECRET)
    srv.register_memory(torch.arange(1 << 12, dtype=torch.int32), name="kv", writable=False)
    srv.register_memory(torch.zeros(1 << 12, dtype=torch.uint8), name="inbox")
    cli = Agent("cli", secret=SECRET)
    dst = torch.zeros(1 << 14, dtype=torch.uint8)
    cli.register_memory(dst)
    liar = Agent("liar", secret=OTHER)
    liar.register_memory(torch.zeros(1 << 12, dtype=torch.uint8))
    async with srv, cli, liar:
        md_bytes = srv.get_agent_metadata()
        seen.append(md_bytes.decode("latin-1"))
        cli.add_remote_agent(md_bytes)
        kv = srv.registry.get("kv")
        url = f"http://127.0.0.1:{srv.port}"
        # a good READ first: its debug logging counts too
        h = cli.initialize_xfer("READ", cli.get_xfer_descs([(dst.data_ptr(), 4096, 0)], "DRAM"),
                                cli.get_xfer_descs([kv.desc(0, 4096)], "DRAM"), "srv")
        await cli.transfer(h, timeout=10)
        h.release()
        # 1. wrong secret: refused locally (key id), then by the server with forged metadata
        with pytest.raises(E.TransportConfigError) as ei:
            liar.add_remote_agent(md_bytes)
        keep(ei.value)
        md = wire.decode_metadata(md_bytes)
        liar.add_remote_agent(wire.encode_metadata(dataclasses.replace(md, key_id=liar._key_id)))
        h = liar.initialize_xfer("READ", liar.get_xfer_descs(liar.registry.infos()),
                                 liar.get_xfer_descs([kv.desc(0, 4096)], "DRAM"), "srv")
        with pytest.raises(E.AuthenticationFailed) as ei:
            await liar.transfer(h, timeout=10)
        keep(ei.value)
        with pytest.raises(E.AuthenticationFailed) as ei:
            await liar.send_notif("srv", b"spoof")
        keep(ei.value)
        # 2. no signature, a bad signature, a replay, a stale timestamp, a malformed document
        doc = wire.encode_doc([list(kv.desc(0, 16))], "DRAM", b"")
        body = wire.DOC_LEN.pack(len(doc)) + doc
        good = cli.signer.headers("POST", wire.PATH_READ, doc, to="srv", to_instance=srv.instance)
        bad_sig = dict(good, **{auth.H_SIG: "00" * 32})
        stale = dict(good, **{auth.H_TIME: f"{time.time() - 3600:.6f}"})
        junk = b"\xff" * 40
        junk_headers = cli.signer.headers("POST", wire.PATH_READ, junk[4:], to="srv",
                                          to_instance=srv.instance)
        results = [await _raw(url + wire.PATH_READ, body, {}),
                   await _raw(url + wire.PATH_READ, body, bad_sig),
                   await _raw(url + wire.PATH_READ, body, good),
                   await _raw(url + wire.PATH_READ, body, good),       # the replay
                   await _raw(url + wire.PATH_READ, body, stale),
                   await _raw(url + wire.PATH_READ, wire.DOC_LEN.pack(36) + junk[4:], junk_headers),
                   await _raw(url + wire.PATH_NOTIF, b"x", bad_sig)]
        codes = [code for _, code, _ in results]
        assert codes[:5] == ["auth_failed", "auth_failed", "", "replayed", "replayed"], codes
        assert results[5][0] >= 400 and results[6][0] == 401, results
        seen.extend(text for _, _, text in results)
        seen.append(repr(dict(srv.stats)) + repr(dict(cli.stats)))
    # 3. configuration errors name the rule, never the value
    with pytest.raises(E.TransportConfigError) as ei:
        Agent("short", secret=SECRET[:8])
    keep(ei.value)
    haystack = "\n".join(seen) + "\n" + caplog.text + "\n" + "\n".join(
        r.getMessage() + repr(r.args) for r in caplog.records)
    assert len(seen) > 10 and srv.stats["requests_refused"] >= 5
    for secret in (SECRET, OTHER, SECRET[:8]):
        for form in _forms(secret):
            assert form not in haystack, f"the secret appears (as {form[:6]}...)"


async def test_per_peer_inflight_limit() -> None:
    """Two slots for each peer: a third concurrent call from one peer gets 429 / PeerBusy at
    once (not queued), a second peer is served meanwhile, and the slots come back."""
    release = asyncio.Event()
    entered = 0

    async def slow(sender: str, payload: object) -> object:
        nonlocal entered
        entered += 1
        await release.wait()
        return {"from": sender}

    srv = Agent("srv", secret=SECRET, max_inflight_per_peer=2)
    srv.add_json_route("/slow", slow)
    a, b = Agent("a", secret=SECRET), Agent("b", secret=SECRET)
    async with srv, a, b:
        for c in (a, b):
            c.add_remote_agent(srv.get_agent_metadata())
        first = [asyncio.create_task(a.call("srv", "/slow", 1, timeout=20)) for _ in range(2)]
        while entered < 2:
            await asyncio.sleep(0.01)
        assert srv.inflight == {"a": 2}
        with pytest.raises(E.PeerBusy, match="max_inflight_per_peer=2"):
            await a.call("srv", "/slow", 3, timeout=20)
        assert srv.stats["requests_busy"] == 1
        other = asyncio.create_task(b.call("srv", "/slow", 1, timeout=20))   # another peer
        while entered < 3:
            await asyncio.sleep(0.01)
        assert srv.inflight == {"a": 2, "b": 1}
        release.set()
        assert await asyncio.gather(*first, other) == [{"from": "a"}] * 2 + [{"from": "b"}]
        assert srv.inflight == {}
        assert await a.call("srv", "/slow", 4, timeout=20) == {"from": "a"}   # slots came back
        assert srv.inflight == {}


def test_inflight_limit_must_be_positive() -> None:
    with pytest.raises(E.TransportConfigError):
        Agent("x", secret=SECRET, max_inflight_per_peer=0)
