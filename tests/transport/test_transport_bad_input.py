"""Bad input to the HTTP transport, one test per condition of the acceptance list.

Each test checks three things: the caller gets the specific exception, the server keeps serving
(a good transfer succeeds afterwards), and no registered byte changed (checksums of every
registered range on the serving agent). The peer-death case is in test_transport_peer_death.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import struct
import time

import aiohttp
import orjson
import pytest
import torch

from tract_async.transport import auth, wire
from tract_async.transport import errors as E
from tract_async.transport.http import Agent

SECRET = b"test-secret-0123456789abcdef"
OTHER = b"another-secret-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


class Rig:
    """A serving agent with a read-only export and a writable inbox, plus a good client."""

    def __init__(self, srv: Agent, cli: Agent, dst: torch.Tensor) -> None:
        self.srv, self.cli, self.dst = srv, cli, dst
        self.url = f"http://127.0.0.1:{srv.port}"
        self.kv = srv.registry.get("kv")
        self.inbox = srv.registry.get("inbox")

    def digest(self) -> list[str]:
        """sha256 of every registered range of the server."""
        return [hashlib.sha256(self.srv.registry.view(r.name)).hexdigest() for r in self.srv.registry.infos()]

    async def still_serves(self) -> None:
        self.cli.add_remote_agent(self.srv.get_agent_metadata())  # undo any forged metadata
        h = self.cli.initialize_xfer("READ", self.cli.get_xfer_descs([(self.dst.data_ptr(), 4096, 0)], "DRAM"),
                                     self.cli.get_xfer_descs([self.kv.desc(0, 4096)], "DRAM"), "srv")
        self.dst.zero_()
        await self.cli.transfer(h, timeout=10)
        assert bytes(self.dst[:4096].numpy()) == bytes(self.srv.registry.view("kv")[:4096])
        h.release()

    def signed(self, path: str, doc: bytes) -> dict[str, str]:
        """The good client's auth headers for a POST of ``path`` to the server."""
        return self.cli.signer.headers("POST", path, doc, to=self.srv.name, to_instance=self.srv.instance)

    async def raw(self, path: str, body: bytes, headers: dict[str, str], method: str = "POST") -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            async with s.request(method, self.url + path, data=body, headers=headers) as r:
                await r.read()
                return r.status, r.headers.get(wire.H_ERROR, "")


@pytest.fixture
async def rig():
    srv = Agent("srv", secret=SECRET, max_request_bytes=1 << 20, max_descs=64, max_doc_bytes=1 << 16,
                io_timeout_s=5.0)
    srv.register_memory(torch.arange(1 << 16, dtype=torch.int32), name="kv", writable=False)  # 256 KiB
    srv.register_memory(torch.full((1 << 16,), 0x5A, dtype=torch.uint8), name="inbox")
    cli = Agent("cli", secret=SECRET)
    dst = torch.zeros(1 << 21, dtype=torch.uint8)
    cli.register_memory(dst)
    await srv.start()
    await cli.start()
    cli.add_remote_agent(srv.get_agent_metadata())
    r = Rig(srv, cli, dst)
    before = r.digest()
    try:
        yield r
        assert r.digest() == before, "a registered byte of the server changed"
        await r.still_serves()
    finally:
        await cli.close()
        await srv.close()


def framed(rows: list[list[int]], notif: bytes = b"", mem_type: str = "DRAM") -> tuple[bytes, bytes]:
    doc = wire.encode_doc(rows, mem_type, notif)
    return doc, wire.DOC_LEN.pack(len(doc)) + doc


# --- metadata ------------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    b"", b"TRACTMD", b"NOTOURS\x00\x02\x00{}", b"TRACTMD\x00\x02\x00{not json",
    b"TRACTMD\x00\x02\x00[]", b'TRACTMD\x00\x02\x00{"name": "x"}',
    b'TRACTMD\x00\x02\x00{"name":"x","host":"h","port":"80","auth":"hmac","key_id":"k","regions":[]}',
    b'TRACTMD\x00\x02\x00{"name":"x","instance":"' + b"0" * 32
    + b'","host":"h","port":80,"auth":"hmac","key_id":"k","regions":[{"name":1}]}',
    b'TRACTMD\x00\x02\x00{"name":"x","host":"h","port":0,"auth":"hmac","key_id":"k","regions":[]}',
    b'TRACTMD\x00\x02\x00{"name":"x","host":"h","port":80,"auth":"hmac","key_id":"k","regions":[]}',
    b'TRACTMD\x00\x02\x00{"name":"x","instance":"not-hex","host":"h","port":80,"auth":"hmac","key_id":"k",'
    b'"regions":[]}',
])
async def test_malformed_metadata(rig, data):
    with pytest.raises(E.MetadataError):
        rig.cli.add_remote_agent(data)
    assert rig.cli.remote_agent("srv").name == "srv"  # the good entry is untouched


async def test_wrong_metadata_version_checked_before_decoding(rig):
    good = rig.srv.get_agent_metadata()
    # Version 1 (before the instance field) followed by garbage: the version check must fire,
    # not the JSON decoder.
    with pytest.raises(E.MetadataVersionMismatch, match="version 1"):
        rig.cli.add_remote_agent(good[:8] + struct.pack("<H", 1) + b"\xff garbage")
    with pytest.raises(E.MetadataVersionMismatch):
        rig.cli.add_remote_agent(good[:8] + struct.pack("<H", 0) + good[10:])


# --- authentication ------------------------------------------------------------------------------
async def test_wrong_secret_is_refused(rig):
    liar = Agent("liar", secret=OTHER)
    liar.register_memory(torch.zeros(1 << 16, dtype=torch.uint8))
    async with liar:
        with pytest.raises(E.TransportConfigError, match="different shared secret"):
            liar.add_remote_agent(rig.srv.get_agent_metadata())
        # Forged metadata that claims our key id gets past the local check; the server refuses.
        md = wire.decode_metadata(rig.srv.get_agent_metadata())
        liar.add_remote_agent(wire.encode_metadata(dataclasses.replace(md, key_id=liar._key_id)))
        for op, region in (("READ", rig.kv), ("WRITE", rig.inbox)):
            h = liar.initialize_xfer(op, liar.get_xfer_descs(liar.registry.infos()),
                                     liar.get_xfer_descs([region.desc(0, 1 << 16)], "DRAM"), "srv")
            with pytest.raises(E.AuthenticationFailed, match="signature"):
                await liar.transfer(h, timeout=10)
        with pytest.raises(E.AuthenticationFailed):
            await liar.send_notif("srv", b"spoof")
    assert rig.srv.get_new_notifs() == {}


async def test_missing_secret_is_refused(rig):
    doc, body = framed([list(rig.kv.desc(0, 16))])
    status, code = await rig.raw(wire.PATH_READ, body, {})
    assert (status, code) == (401, "auth_failed")
    anon = Agent("anon", allow_unauthenticated=True)
    anon.register_memory(torch.zeros(16, dtype=torch.uint8))
    async with anon:
        md = wire.decode_metadata(rig.srv.get_agent_metadata())
        anon.add_remote_agent(wire.encode_metadata(dataclasses.replace(md, key_id="none")))
        h = anon.initialize_xfer("READ", anon.get_xfer_descs(anon.registry.infos()),
                                 anon.get_xfer_descs([rig.kv.desc(0, 16)], "DRAM"), "srv")
        with pytest.raises(E.AuthenticationFailed, match="missing"):
            await anon.transfer(h, timeout=10)


async def test_replayed_request_is_refused(rig):
    doc, body = framed([list(rig.inbox.desc(0, 8))], notif=b"once")
    headers = rig.signed(wire.PATH_WRITE, doc)
    payload = body + b"\x01" * 8
    assert await rig.raw(wire.PATH_WRITE, payload, headers) == (200, "")
    after_first = rig.digest()  # the first, legitimate write changed the inbox
    assert await rig.raw(wire.PATH_WRITE, payload, headers) == (401, "replayed")
    assert rig.digest() == after_first
    assert rig.srv.get_new_notifs() == {"cli": [b"once"]}  # delivered once, not twice
    # A stale timestamp with a valid signature is refused as a replay too.
    ts, nonce = f"{time.time() - 3600:.6f}", "ab" * 16
    inst = rig.srv.instance
    sig = hmac.new(SECRET, auth._canonical("POST", wire.PATH_READ, "cli", "srv", inst, ts, nonce, doc),
                   hashlib.sha256).hexdigest()
    stale = {auth.H_AGENT: "cli", auth.H_TO: "srv", auth.H_TO_INSTANCE: inst, auth.H_TIME: ts, auth.H_NONCE: nonce,
             auth.H_SIG: sig}
    _, rbody = framed([list(rig.kv.desc(0, 8))])
    assert (await rig.raw(wire.PATH_READ, rbody, stale))[1] == "replayed"
    # Undo the one legitimate write so the fixture's "nothing changed" check holds.
    rig.srv.registry.view("inbox")[:8] = b"\x5a" * 8


# --- descriptors and sizes ---------------------------------------------------------------------------
async def test_out_of_range_descriptor(rig):
    # Stale or forged metadata advertising a bigger region: the server's own check refuses.
    md = wire.decode_metadata(rig.srv.get_agent_metadata())
    big = tuple(dataclasses.replace(r, nbytes=r.nbytes * 4) for r in md.regions)
    rig.cli.add_remote_agent(wire.encode_metadata(dataclasses.replace(md, regions=big)))
    for op, region in (("READ", rig.kv), ("WRITE", rig.inbox)):
        # (Depending on where the allocator put the two ranges, the client's own check against the
        # forged metadata may already refuse it; either way the caller gets DescriptorOutOfRange.)
        with pytest.raises(E.DescriptorOutOfRange):
            h = rig.cli.initialize_xfer(op, rig.cli.get_xfer_descs([(rig.dst.data_ptr(), 4096, 0)], "DRAM"),
                                        rig.cli.get_xfer_descs([(region.addr + region.nbytes - 100, 4096, 0)], "DRAM"),
                                        "srv")
            await rig.cli.transfer(h, timeout=10)
    # WRITE into the read-only export (metadata forged writable) is refused by the server too.
    rw = tuple(dataclasses.replace(r, writable=True) for r in md.regions)
    rig.cli.add_remote_agent(wire.encode_metadata(dataclasses.replace(md, regions=rw)))
    h = rig.cli.initialize_xfer("WRITE", rig.cli.get_xfer_descs([(rig.dst.data_ptr(), 64, 0)], "DRAM"),
                                rig.cli.get_xfer_descs([rig.kv.desc(0, 64)], "DRAM"), "srv")
    with pytest.raises(E.DescriptorOutOfRange, match="read-only"):
        await rig.cli.transfer(h, timeout=10)
    rig.cli.add_remote_agent(rig.srv.get_agent_metadata())
    # Addresses that are not registered at all, and another device id.
    for row in ([1, 16, 0], [rig.kv.addr, 16, 3], [rig.kv.addr + rig.kv.nbytes - 8, 16, 0],
                [rig.kv.addr - 8, 16, 0], [rig.kv.addr + 8, rig.kv.nbytes, 0]):
        doc, body = framed([row])
        assert (await rig.raw(wire.PATH_READ, body, rig.signed(wire.PATH_READ, doc)))[1] == \
            "desc_out_of_range"


async def test_truncated_bodies(rig):
    # 1. The declared body is shorter than the descriptors need: refused before any byte lands.
    doc, body = framed([list(rig.inbox.desc(0, 4096))], notif=b"t")
    st = await rig.raw(wire.PATH_WRITE, body + b"\x00" * 100, rig.signed(wire.PATH_WRITE, doc))
    assert st == (400, "truncated")
    # 2. The descriptor document is cut short.
    st = await rig.raw(wire.PATH_READ, body[:20], rig.signed(wire.PATH_READ, doc))
    assert st == (400, "truncated")
    # 3. The writer promises the full length, sends part, and hangs up (raw socket).
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.srv.port)
    hdrs = rig.signed(wire.PATH_WRITE, doc)
    head = (f"POST {wire.PATH_WRITE} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body) + 4096}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n").encode()
    refused = rig.srv.stats["requests_refused"]
    writer.write(head + body)  # the descriptor document and none of the payload
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(10):  # the server notices the short body and refuses the request
        while rig.srv.stats["requests_refused"] == refused:
            await asyncio.sleep(0.01)
    assert rig.srv.get_new_notifs() == {}  # no notification: the write never completed


async def test_oversized_requests(rig):
    # Too many bytes (limit 1 MiB) and too many descriptors (limit 64).
    rows = [list(rig.kv.desc(0, 1 << 18))] * 5          # 5 x 256 KiB > 1 MiB
    doc, body = framed(rows)
    assert await rig.raw(wire.PATH_READ, body, rig.signed(wire.PATH_READ, doc)) == (413, "too_large")
    doc, body = framed([list(rig.kv.desc(0, 16))] * 65)
    assert await rig.raw(wire.PATH_READ, body, rig.signed(wire.PATH_READ, doc)) == (413, "too_large")
    # A document longer than max_doc_bytes is refused from its length prefix, unread.
    st = await rig.raw(wire.PATH_READ, wire.DOC_LEN.pack(1 << 30) + b"x" * 16, rig.signed(wire.PATH_READ, b""))
    assert st == (413, "too_large")
    # Through the client API the same refusal arrives as RequestTooLarge.
    local = rig.cli.get_xfer_descs([(rig.dst.data_ptr() + i * (1 << 18), 1 << 18, 0) for i in range(5)], "DRAM")
    h = rig.cli.initialize_xfer("READ", local, rig.cli.get_xfer_descs([rig.kv.desc(0, 1 << 18)] * 5, "DRAM"), "srv")
    with pytest.raises(E.RequestTooLarge):
        await rig.cli.transfer(h, timeout=10)
    notif = rig.signed(wire.PATH_NOTIF, b"n" * (128 << 10))
    assert (await rig.raw(wire.PATH_NOTIF, b"n" * (128 << 10), notif))[1] == "too_large"


async def test_malformed_document(rig):
    for doc in (b"{", b"[]", orjson.dumps({"mem_type": "DRAM", "descs": [[1, 2]]}),
                orjson.dumps({"mem_type": "HBM", "descs": [[1, 2, 0]]}),
                orjson.dumps({"mem_type": "DRAM", "descs": [[1.5, 2, 0]]}),
                orjson.dumps({"mem_type": "DRAM", "descs": [[1, 2, 0]], "notif": "%%%"})):
        body = wire.DOC_LEN.pack(len(doc)) + doc
        assert await rig.raw(wire.PATH_READ, body, rig.signed(wire.PATH_READ, doc)) == \
            (400, "malformed")


# --- timeouts ------------------------------------------------------------------------------------
async def test_timeout_on_a_silent_peer(rig):
    """A peer that accepts the connection and never answers: TransferTimeout, honest cancel."""
    accepted = asyncio.Event()
    conns: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        accepted.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        md = wire.decode_metadata(rig.srv.get_agent_metadata())
        rig.cli.add_remote_agent(wire.encode_metadata(dataclasses.replace(md, name="silent", port=port)))
        before = bytes(rig.dst[:4096].numpy())
        h = rig.cli.initialize_xfer("READ", rig.cli.get_xfer_descs([(rig.dst.data_ptr(), 4096, 0)], "DRAM"),
                                    rig.cli.get_xfer_descs([rig.kv.desc(0, 4096)], "DRAM"), "silent")
        rig.cli.post_xfer(h)
        await asyncio.wait_for(accepted.wait(), 10)
        with pytest.raises(E.TransferTimeout, match="cancelled"):
            await rig.cli.transfer(h, timeout=0.2)
        with pytest.raises(E.TransferTimeout):
            rig.cli.check_xfer_state(h)   # the failure stays visible to polling
        assert bytes(rig.dst[:4096].numpy()) == before
        with pytest.raises(E.NotificationTimeout):
            await rig.cli.wait_notif("silent", timeout=0.05)
    finally:
        for w in conns:
            w.close()
        server.close()
        await server.wait_closed()


async def test_unreachable_peer(rig):
    md = wire.decode_metadata(rig.srv.get_agent_metadata())
    s = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = s.sockets[0].getsockname()[1]
    s.close()
    await s.wait_closed()  # the port is now (very likely) closed: connect is refused
    rig.cli.add_remote_agent(wire.encode_metadata(dataclasses.replace(md, name="gone", port=port)))
    h = rig.cli.initialize_xfer("READ", rig.cli.get_xfer_descs([(rig.dst.data_ptr(), 16, 0)], "DRAM"),
                                rig.cli.get_xfer_descs([rig.kv.desc(0, 16)], "DRAM"), "gone")
    with pytest.raises(E.PeerUnreachable):
        await rig.cli.transfer(h, timeout=10)


# --- the direct READ client (transport/conn.py) against a lying or stalling peer ----------------------
async def _fake_peer(rig: Rig, name: str, reply: bytes, *, then_stall: bool = False,
                     stall_first: float = 0.0) -> tuple[asyncio.AbstractServer, list[asyncio.StreamWriter]]:
    """A TCP server that answers every request with ``reply`` (optionally never finishing it)."""
    conns: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        if not then_stall:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    md = wire.decode_metadata(rig.srv.get_agent_metadata())
    rig.cli.add_remote_agent(wire.encode_metadata(dataclasses.replace(
        md, name=name, port=server.sockets[0].getsockname()[1])))
    return server, conns


@pytest.mark.parametrize("reply, exc", [
    (b"garbage\r\n\r\n", E.PeerDisconnected),                                    # no status line
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789", E.RemoteError),  # wrong length
    (b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n" + b"x" * 100, E.PeerDisconnected),  # short body
    (b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\nContent-Length: 4097\r\n\r\n", E.PeerDisconnected),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * (70 << 10) + b"\r\n\r\n", E.PeerDisconnected),  # head too long
    (b"HTTP/1.1 401 Unauthorized\r\nX-Tract-Error: auth_failed\r\nContent-Length: 2\r\n\r\n{}",
     E.AuthenticationFailed),
])
async def test_direct_read_refuses_bad_responses(rig, reply, exc):
    server, conns = await _fake_peer(rig, "liar", reply)
    try:
        before = bytes(rig.dst[:4096].numpy())
        h = rig.cli.initialize_xfer("READ", rig.cli.get_xfer_descs([(rig.dst.data_ptr(), 4096, 0)], "DRAM"),
                                    rig.cli.get_xfer_descs([rig.kv.desc(0, 4096)], "DRAM"), "liar")
        with pytest.raises(exc):
            await rig.cli.transfer(h, timeout=10)
        if exc is not E.PeerDisconnected or b"x" * 100 not in reply:
            assert bytes(rig.dst[:4096].numpy()) == before
    finally:
        for w in conns:
            w.close()
        server.close()
        await server.wait_closed()


async def test_direct_read_io_timeout_mid_body(rig):
    """Headers and part of the body, then silence: the io timeout (not the transfer deadline) fires,
    and nothing lands after the transfer failed."""
    cli = Agent("cli2", secret=SECRET, io_timeout_s=0.3)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    cli.register_memory(dst)
    await cli.start()
    rig_cli, rig.cli = rig.cli, cli
    server, conns = await _fake_peer(rig, "staller", b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n"
                                     + b"\x07" * 5000, then_stall=True)
    try:
        local = cli.get_xfer_descs([(dst.data_ptr() + i * (1 << 18), 1 << 18, 0) for i in range(4)], "DRAM")
        h = cli.initialize_xfer("READ", local, cli.get_xfer_descs([rig.kv.desc(0, 1 << 18)] * 4, "DRAM"), "staller")
        with pytest.raises(E.TransferTimeout, match="stalled"):
            await cli.transfer(h, timeout=30)
        assert h.bytes_done == 5000
        for w in conns:
            w.write(b"\x09" * 4096)   # late bytes must not land
        await asyncio.sleep(0.1)
        assert int((dst == 9).sum()) == 0
    finally:
        rig.cli = rig_cli
        for w in conns:
            w.close()
        server.close()
        await server.wait_closed()
        await cli.close()


async def test_direct_read_survives_a_closed_keepalive_connection(rig):
    """The server drops idle keep-alive connections; the next READ retries on a fresh one."""
    await rig.still_serves()
    pool = rig.cli.read_pool
    idle = [c for conns in pool._idle.values() for c in conns]
    assert idle, "the READ connection was not kept alive"
    # Close the server side of every idle connection, as a keep-alive timeout would.
    for proto in list(rig.srv._runner.server.connections):  # type: ignore[union-attr]
        proto.transport.close()
    await asyncio.sleep(0.05)   # the client has seen the EOF: the dead connection is skipped
    await rig.still_serves()
    for proto in list(rig.srv._runner.server.connections):  # type: ignore[union-attr]
        proto.transport.close()
    await rig.still_serves()    # no EOF seen yet when the request goes out: retried on a fresh one
