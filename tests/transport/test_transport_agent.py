"""The HTTP Agent's normal operation: registration, metadata, READ/WRITE, polling, notifications,
application routes, lifecycle. Bad input lives in test_transport_bad_input.py."""
from __future__ import annotations

import asyncio
import ctypes
import mmap

import numpy as np
import pytest
import torch

from tract_async.errors import TractError
from tract_async.transport import errors as E
from tract_async.transport.descs import XferDescList
from tract_async.transport.http import Agent

SECRET = b"test-secret-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def pair():
    """A serving agent 'prefill' (KV exported read-only + a writable inbox) and a client 'decode'."""
    prefill = Agent("prefill", secret=SECRET, chunk_bytes=64 << 10)
    decode = Agent("decode", secret=SECRET, chunk_bytes=64 << 10)
    kv = torch.arange(1 << 18, dtype=torch.int32)           # 1 MiB, deterministic content
    inbox = torch.zeros(1 << 18, dtype=torch.uint8)
    prefill.register_memory(kv, name="kv", writable=False)
    prefill.register_memory(inbox, name="inbox")
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    decode.register_memory(dst, name="dst")
    await prefill.start()
    await decode.start()
    decode.add_remote_agent(prefill.get_agent_metadata())
    prefill.add_remote_agent(decode.get_agent_metadata())
    try:
        yield prefill, decode, kv, inbox, dst
    finally:
        await decode.close()
        await prefill.close()


async def test_read_whole_region_and_notify(pair):
    prefill, decode, kv, _, dst = pair
    remote = decode.get_xfer_descs(decode.remote_region("prefill", "kv"))
    h = decode.initialize_xfer("READ", decode.get_xfer_descs(dst), remote, "prefill", b"req-1")
    assert decode.check_xfer_state(h) == "INIT"
    await decode.transfer(h, timeout=10)
    assert decode.check_xfer_state(h) == "DONE"
    assert torch.equal(dst.view(torch.int32), kv)
    # The notification is sent after the bytes landed, so waiting for it is a completion signal.
    assert await prefill.wait_notif("decode", b"req-1", timeout=5) == b"req-1"
    assert prefill.get_new_notifs() == {}
    h.release()
    h.release()  # idempotent
    with pytest.raises(E.HandleReleased):
        decode.check_xfer_state(h)


async def test_read_scattered_descriptors_straddling_chunks(pair):
    """Many descriptors of odd sizes: received chunks straddle descriptor boundaries."""
    _, decode, kv, _, dst = pair
    r = decode.remote_region("prefill", "kv")
    src_bytes = kv.view(torch.uint8)
    sizes = [1, 4095, 70001, 3, 200000, 12345]
    remote_rows, local_rows, off_r, off_l = [], [], 7, 100
    for n in sizes:
        remote_rows.append(r.desc(off_r, n))
        local_rows.append((dst.data_ptr() + off_l, n, 0))
        off_r += n + 13
        off_l += n + 1
    h = decode.initialize_xfer("READ", decode.get_xfer_descs(local_rows, "DRAM"),
                               decode.get_xfer_descs(remote_rows, "DRAM"), "prefill")
    await decode.transfer(h, timeout=10)
    expect = torch.zeros_like(dst)
    for (ra, n, _), (la, _, _) in zip(remote_rows, local_rows):
        expect[la - dst.data_ptr():la - dst.data_ptr() + n] = src_bytes[ra - r.addr:ra - r.addr + n]
    assert torch.equal(dst, expect)


async def test_write_lands_and_notifies(pair):
    prefill, decode, _, inbox, dst = pair
    dst[: inbox.numel()] = torch.arange(inbox.numel(), dtype=torch.int64).to(torch.uint8)
    remote = decode.get_xfer_descs(decode.remote_region("prefill", "inbox"))
    local = decode.get_xfer_descs([(dst.data_ptr(), inbox.numel(), 0)], "DRAM")
    h = decode.initialize_xfer("WRITE", local, remote, "prefill", b"w1")
    await decode.transfer(h, timeout=10)
    assert torch.equal(inbox, dst[: inbox.numel()])
    assert prefill.get_new_notifs() == {"decode": [b"w1"]}


async def test_polling_and_concurrent_transfers(pair):
    """NIXL-style post + poll, several in flight on pooled connections."""
    _, decode, kv, _, dst = pair
    r = decode.remote_region("prefill", "kv")
    quarter = r.nbytes // 4
    handles = []
    for i in range(4):
        h = decode.initialize_xfer(
            "READ", decode.get_xfer_descs([(dst.data_ptr() + i * quarter, quarter, 0)], "DRAM"),
            decode.get_xfer_descs([r.desc(i * quarter, quarter)], "DRAM"), "prefill")
        assert decode.post_xfer(h) == "PROC"
        with pytest.raises(E.TransferInProgress):
            decode.post_xfer(h)
        handles.append(h)
    await asyncio.wait_for(asyncio.gather(*(decode.transfer(h, timeout=10) for h in handles)), 20)
    assert [decode.check_xfer_state(h) for h in handles] == ["DONE"] * 4
    assert torch.equal(dst.view(torch.int32), kv)
    # A finished handle can be posted again (NIXL re-post semantics).
    dst.zero_()
    await decode.transfer(handles[0], timeout=10)
    assert torch.equal(dst[:quarter], kv.view(torch.uint8)[:quarter])


async def test_register_numpy_mmap_and_raw_range():
    async with Agent("srv", secret=SECRET) as srv, Agent("cli", secret=SECRET) as cli:
        arr = np.arange(4096, dtype=np.uint16)
        m = mmap.mmap(-1, 8192)
        m[:8192] = bytes(range(256)) * 32
        keep = (ctypes.c_uint8 * 4096)(*([7] * 4096))
        srv.register_memory(arr, name="np")
        srv.register_memory(m, name="mm")
        srv.register_memory((ctypes.addressof(keep), 4096), name="raw")
        with pytest.raises(E.MemoryAlreadyRegistered):
            srv.register_memory((ctypes.addressof(keep) + 100, 10), name="overlap")
        with pytest.raises(E.MemoryAlreadyRegistered):
            srv.register_memory(np.zeros(4), name="np")
        cli.add_remote_agent(srv.get_agent_metadata())
        dst = np.zeros(8192 + 8192 + 4096, dtype=np.uint8)
        cli.register_memory(dst)
        rows, off = [], dst.ctypes.data
        for region in ("np", "mm", "raw"):
            info = cli.remote_region("srv", region)
            rows.append((off, info.nbytes, 0))
            off += info.nbytes
        remote = cli.get_xfer_descs([cli.remote_region("srv", n) for n in ("np", "mm", "raw")])
        h = cli.initialize_xfer("READ", cli.get_xfer_descs(rows, "DRAM"), remote, "srv")
        await cli.transfer(h, timeout=10)
        assert dst[:8192].tobytes() == arr.tobytes()
        assert dst[8192:16384].tobytes() == m[:8192]
        assert (dst[16384:] == 7).all()
        srv.deregister_memory("mm")
        m.close()


async def test_json_route_lookup_and_fetch_metadata():
    """An engine-style key -> descriptors lookup served on the agent's own (authenticated) server."""
    srv = Agent("prefill", secret=SECRET)
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    info = srv.register_memory(kv, name="kv", writable=False)
    table = {"blk-a": [info.desc(0, 4096)], "blk-b": [info.desc(4096, 8192)]}

    async def lookup(sender: str, keys: list[str]) -> dict:
        assert sender == "decode"
        return {"descs": [table.get(k) for k in keys]}

    srv.add_json_route("/kv/lookup", lookup)
    with pytest.raises(E.TransportConfigError):
        srv.add_json_route("/tract/v1/read", lookup)
    async with srv, Agent("decode", secret=SECRET) as cli:
        with pytest.raises(E.TransportConfigError):
            srv.add_json_route("/late", lookup)
        name = await cli.fetch_remote_metadata(f"http://127.0.0.1:{srv.port}")
        assert name == "prefill"
        reply = await cli.call("prefill", "/kv/lookup", ["blk-b", "nope"], timeout=5)
        assert reply == {"descs": [[list(table["blk-b"][0])], None]}


async def test_standalone_notif_and_wait_timeout(pair):
    prefill, decode, *_ = pair
    waiter = asyncio.create_task(prefill.wait_notif("decode", b"tag:", prefix=True, timeout=5))
    await asyncio.sleep(0)  # let the waiter block first, so the wake-up path is exercised
    await decode.send_notif("prefill", b"tag:42")
    assert await waiter == b"tag:42"
    with pytest.raises(E.NotificationTimeout):
        await prefill.wait_notif("decode", timeout=0.05)


async def test_misuse_errors(pair):
    prefill, decode, kv, _, dst = pair
    remote = decode.get_xfer_descs(decode.remote_region("prefill", "kv"))
    local = decode.get_xfer_descs(dst)
    with pytest.raises(E.InvalidOperation):
        decode.initialize_xfer("COPY", local, remote, "prefill")
    with pytest.raises(E.InvalidDescriptors):  # lengths differ (1 MiB vs 1 MiB + 0) pairwise
        decode.initialize_xfer("READ", decode.get_xfer_descs([(dst.data_ptr(), 10, 0)], "DRAM"), remote, "prefill")
    with pytest.raises(E.UnknownRemoteAgent):
        decode.initialize_xfer("READ", local, remote, "nobody")
    with pytest.raises(E.MemoryNotRegistered):  # local side not registered
        decode.initialize_xfer("READ", decode.get_xfer_descs(torch.zeros(1 << 20, dtype=torch.uint8)),
                               remote, "prefill")
    with pytest.raises(E.DescriptorOutOfRange):  # WRITE into a read-only export, refused locally
        decode.initialize_xfer("WRITE", local, remote, "prefill")
    with pytest.raises(E.InvalidDescriptors):
        XferDescList([(1, 0, 0)])
    # Deregistering memory that a posted transfer still uses is refused (no reuse under a transfer).
    h = decode.initialize_xfer("READ", local, remote, "prefill")
    decode.post_xfer(h)
    with pytest.raises(E.TransferInProgress):
        decode.deregister_memory("dst")
    await decode.transfer(h, timeout=10)
    assert issubclass(E.TransferTimeout, TractError) and issubclass(E.TransferTimeout, TimeoutError)


def test_config_requires_secret_and_loopback_for_unauthenticated():
    with pytest.raises(E.TransportConfigError, match="secret is required"):
        Agent("a")
    with pytest.raises(E.TransportConfigError, match="loopback"):
        Agent("a", allow_unauthenticated=True, host="0.0.0.0")
    with pytest.raises(E.TransportConfigError, match="16 bytes"):
        Agent("a", secret=b"short")
    Agent("a", allow_unauthenticated=True)  # loopback: allowed by explicit opt-in


async def test_unauthenticated_loopback_pair_works():
    async with Agent("s", allow_unauthenticated=True) as s, Agent("c", allow_unauthenticated=True) as c:
        src = torch.full((4096,), 9, dtype=torch.uint8)
        s.register_memory(src, name="x")
        c.add_remote_agent(s.get_agent_metadata())
        dst = torch.zeros(4096, dtype=torch.uint8)
        c.register_memory(dst)
        h = c.initialize_xfer("READ", c.get_xfer_descs(dst), c.get_xfer_descs(c.remote_region("s", "x")), "s")
        await c.transfer(h, timeout=5)
        assert torch.equal(src, dst)
        # A secret-holding agent refuses to pair with one that has none.
        async with Agent("k", secret=SECRET) as k:
            with pytest.raises(E.TransportConfigError, match="different shared secret"):
                k.add_remote_agent(s.get_agent_metadata())


async def test_close_is_idempotent_and_cancels_in_flight(pair):
    prefill, decode, _, _, dst = pair
    remote = decode.get_xfer_descs(decode.remote_region("prefill", "kv"))
    h = decode.initialize_xfer("READ", decode.get_xfer_descs(dst), remote, "prefill")
    decode.post_xfer(h)
    await decode.close()
    await decode.close()
    assert h.state == "RELEASED"
    with pytest.raises(E.AgentClosed):
        decode.initialize_xfer("READ", decode.get_xfer_descs(dst), remote, "prefill")
