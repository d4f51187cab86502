"""The Engine over the HTTP transport: directory, announcements, validation, peers, bad input.

Engines run real Agents on 127.0.0.1, port 0. The transport-independent behaviour (put/get,
layer streaming, waiting consumers, modes, bad tensors) is covered by test_engine.py, which runs
over both transports; this file covers what only the HTTP path has.
"""
from __future__ import annotations

import pytest
import torch

import tract_async as tract
from tract_async import errors as E
from tract_async.stores.http import ROUTE_ANNOUNCE, ROUTE_CHECK, ROUTE_HELLO
from tract_async.transport import errors as TE
from tract_async.transport.http import Agent
from tests.support import engine_http_util as U
from tests.support.engine_http_util import SECRET, http_cfg, http_pair
from tests.support.engine_util import TINY, block_matches, kv_for_keys


def _put_ops(eng: tract.Engine, keys: list[bytes], peer: str) -> list[list]:
    """What ``eng``'s directory says ``peer`` announced for ``keys``, as announce ops."""
    d = eng._store.directory
    return [["p", k.hex(), d[k][peer].slot, d[k][peer].version, format(d[k][peer].mask, "x"),
             d[k][peer].complete] for k in keys]


async def test_stale_directory_entry_is_a_miss_not_wrong_bytes() -> None:
    # a pool of 4 slots: a second batch of 4 blocks evicts the first and reuses its slots
    a, b = await http_pair(http_pool_bytes=4 * TINY.block_bytes)
    try:
        name_a = a._store.agent.name
        k1 = a.block_keys(range(64))
        k2 = a.block_keys(range(1000, 1064))
        await a.put_kv(k1, kv_for_keys(k1))
        assert b.lookup(k1) == 4
        stale = _put_ops(b, k1, name_a)          # what b heard about k1 (slots 0..3)
        await a.put_kv(k2, kv_for_keys(k2))      # LRU evicts k1; its slots now hold k2
        assert a.stats()["evictions_for_space"] == 4 and a.lookup(k1) == 0
        assert b.lookup(k1) == 0, "evictions are announced"
        # A delayed (reordered) announcement brings the old entries back: a stale directory.
        b._store._apply(name_a, stale)
        assert b.lookup(k1) == 4                 # lookup trusts the hint ...
        with pytest.raises(E.BlockEvicted, match="evicted there"):
            await b.get_kv(k1)                   # ... the read does not: a miss, not k2's bytes
        st = b.stats()
        assert st["validation_failures"] == 1 and st["misses"] == 4 and st["hits"] == 0
        assert b.lookup(k1) == 0, "a failed check drops the stale entries"
        # Negative control: without the check the same stale entries hand out k2's bytes.
        b._store._apply(name_a, stale)
        b._store.validate_reads = False
        got = await b.get_kv(k1)
        assert not any(block_matches(k1, got))
        want2, T = kv_for_keys(k2), TINY.block_tokens
        for j in range(4):   # each block read is one of k2's (the slots' new owners)
            assert any(torch.equal(got[:, :, j * T:(j + 1) * T], want2[:, :, i * T:(i + 1) * T])
                       for i in range(4))
    finally:
        await b.close()
        await a.close()


async def test_peering_is_symmetric_and_lookup_is_local() -> None:
    a, b = await http_pair()
    try:
        # b named a; a learnt b from b's hello: a reads what b produces
        keys = b.block_keys(range(48))
        kv = kv_for_keys(keys)
        assert await b.put_kv(keys, kv) == 3
        assert a.lookup(keys) == 3 and a.lookup(keys[:1] + a.block_keys(range(5000, 5016))) == 1
        assert torch.equal(await a.get_kv(keys), kv)
        sa = a.stats()
        assert sa["transport"] == U.TRANSPORT and sa["remote_reads"] == 1
        assert sa["blocks_read_remote"] == 3 and list(sa["peers"]) == [b._store.agent.name]
        # a third engine joining a late gets b's blocks in the hello reply
        c = await tract.Engine.open(http_cfg(2, peers=[a.url, b.url]))
        try:
            assert c.lookup(keys) == 3
            assert torch.equal(await c.get_kv(keys[1:]), kv[:, :, 16:])
        finally:
            await c.close()
        assert len(b.stats()["peers"]) == 1, "a closed peer is forgotten"
    finally:
        await b.close()
        await a.close()


async def test_close_announces_unfinished_and_stored_blocks_gone() -> None:
    a, b = await http_pair()
    try:
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv[0].contiguous(), layer=0)
        assert a.stats()["reserved_in_flight"] == 4
        assert torch.equal(await b.get_kv(keys, layer=0), kv[0])   # streamed layer, over HTTP
        await a.close()
        assert b.lookup(keys) == 0 and b.stats()["peers"] == {}
        with pytest.raises(E.BlockNotFound):
            await b.get_kv(keys, layer=0)
        with pytest.raises(E.TransferTimeout, match="did not appear"):
            await b.get_kv(keys, layer=1, timeout=0.1)
    finally:
        await b.close()
        await a.close()


async def test_peer_gone_without_bye_is_a_miss() -> None:
    a, b = await http_pair()
    try:
        keys = a.block_keys(range(32))
        await a.put_kv(keys, kv_for_keys(keys))
        await a._store.agent.close()             # the server dies; no goodbye reaches b
        with pytest.raises(E.BlockEvicted, match="went away"):
            await b.get_kv(keys)
        assert b.lookup(keys) == 0 and b.stats()["peers_dropped"] == 1
    finally:
        await b.close()
        await a.close()


async def test_closed_engine_and_stats() -> None:
    a = await tract.Engine.open(http_cfg(0))
    s = a.stats()
    assert s["open"] and s["transport"] == U.TRANSPORT and s["fallbacks"] == {}
    assert s["url"] == a.url and a.url.startswith("http://127.0.0.1:") and a.region is None
    await a.close()
    await a.close()   # idempotent
    assert a.url is None
    with pytest.raises(E.EngineClosed):
        a.lookup([])
    with pytest.raises(TE.TransportConfigError, match="secret is required"):
        await tract.Engine.open(http_cfg(0, secret=None))
    with pytest.raises(TE.PeerUnreachable):   # a configured peer that is not there
        await tract.Engine.open(http_cfg(1, peers=["http://127.0.0.1:9"]))


async def test_bad_requests_get_clear_errors_and_change_nothing() -> None:
    a, b = await http_pair()
    intruder = Agent("intruder", secret=SECRET)
    stranger = Agent("stranger", secret=b"another-secret-0123456789abcdef")
    await intruder.start()
    await stranger.start()
    try:
        keys = a.block_keys(range(32))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        before = (dict(b._store.directory), a._store.pool.items(), a._store.pool.free_slots)
        with pytest.raises(TE.AuthenticationFailed):
            await stranger.fetch_remote_metadata(b.url, timeout=5)
        name = await intruder.fetch_remote_metadata(b.url, timeout=5)
        k = keys[0].hex()
        # announce before hello; malformed ops; a bad batch is refused whole
        with pytest.raises(TE.MalformedRequest, match="has not said hello"):
            await intruder.call(name, ROUTE_ANNOUNCE, {"ops": [["p", k, 0, 1, "f", True]]}, timeout=5)
        with pytest.raises(TE.MalformedRequest, match="md"):
            await intruder.call(name, ROUTE_HELLO, {"node": 1}, timeout=5)
        md = __import__("base64").b64encode(a._store.agent.get_agent_metadata()).decode()
        with pytest.raises(TE.MalformedRequest, match="another agent"):
            await intruder.call(name, ROUTE_HELLO, {"md": md, "node": 1}, timeout=5)
        # a proper hello (same secret, a pool): from now on its ops are parsed, and refused whole
        intruder.register_memory(torch.zeros(4 * TINY.block_bytes, dtype=torch.uint8),
                                 name="tract-kv-pool", writable=False)
        md = __import__("base64").b64encode(intruder.get_agent_metadata()).decode()
        reply = await intruder.call(name, ROUTE_HELLO, {"md": md, "node": 7}, timeout=5)
        assert reply["node"] == 1 and [op[1] for op in reply["blocks"]] == []
        for bad in ([["p", k, 0, 1, "f", True], ["p", k[:10], 0, 1, "f", True]], [["p", k, -1, 1, "f", True]],
                    [["p", k, 0, 1, "fffff", True]], [["x"]], [["e", k, 0, "v"]], "ops"):
            with pytest.raises(TE.MalformedRequest):
                await intruder.call(name, ROUTE_ANNOUNCE, {"ops": bad}, timeout=5)
        for bad in ({"e": [[k, 0, 1, 9, False]]}, {"e": [[k, 0, 1]]}, {"e": "x"}, [1]):
            with pytest.raises(TE.MalformedRequest):
                await intruder.call(name, ROUTE_CHECK, bad, timeout=5)
        assert (dict(b._store.directory), a._store.pool.items(), a._store.pool.free_slots) == before
        # still serving
        assert torch.equal(await b.get_kv(keys), kv)
    finally:
        await stranger.close()
        await intruder.close()
        await b.close()
        await a.close()
