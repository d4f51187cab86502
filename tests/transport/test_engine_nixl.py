"""The Engine over NIXL (``transport="nixl"``): the HTTP engine tests again, and what NIXL adds.

* The HTTP transport's engine tests run here a second time with ``TRANSPORT = "nixl"`` (they
  are imported below; the autouse fixture switches ``engine_http_util``), and test_engine.py /
  test_fallback.py run their network cases over NIXL too (a "nixl" parameter / this module).
* Cross-process: a producer engine in a spawned process, the consumer here; bit-exact round
  trips, layer streaming ordered by explicit messages, a producer killed in the middle of a
  128 MiB READ (a typed error, no hang), bad descriptors (typed errors, nothing changed).
* Without nixl: ``transport="nixl"`` raises NixlUnavailable saying how to install it (these run
  whether or not nixl is installed). Everything else is skipped, with that reason, only when
  nixl is not importable; CI installs it (.ci/run).
"""
from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch

import tract_async as tract
from tract_async import errors as E
from tract_async.stores.directory import Directory, parse_ops
from tract_async.stores.http import ROUTE_ANNOUNCE
from tract_async.transport import errors as TE
from tests.support import engine_http_util as U
from tests.support.engine_http_util import http_cfg, http_pair
from tests.support.engine_util import TINY, block_matches, kv_for_keys
from tests.transport.test_engine_http import (  # noqa: F401 - rerun here over NIXL
    test_bad_requests_get_clear_errors_and_change_nothing,
    test_close_announces_unfinished_and_stored_blocks_gone,
    test_closed_engine_and_stats,
    test_peer_gone_without_bye_is_a_miss,
    test_peering_is_symmetric_and_lookup_is_local,
    test_stale_directory_entry_is_a_miss_not_wrong_bytes,
)
from tests.engine.test_fallback import (  # noqa: F401 - the region's fallback picks NIXL when configured
    test_attach_failure_runs_the_engine_on_http,
    test_peer_of_another_rack_is_read_over_http,
    test_region_full_spills_to_http,
)

pytestmark = pytest.mark.timeout(180)
HAVE_NIXL = importlib.util.find_spec("nixl") is not None


@pytest.fixture(autouse=True)
def _over_nixl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine of this module runs on NIXL; skip (saying why) where nixl is missing,
    except in the tests that are about its absence."""
    if "without_nixl" not in request.node.name and not HAVE_NIXL:
        pytest.skip("nixl is not installed (pip install --no-deps nixl nixl-cu12; .ci/run installs it)")
    monkeypatch.setattr(U, "TRANSPORT", "nixl")


# -- without nixl ------------------------------------------------------------------------------
def test_config_without_nixl_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "nixl" else real(n, *a))
    with pytest.raises(E.NixlUnavailable, match=r"pip install .*tract-async\[nixl\].*--no-deps nixl nixl-cu12"):
        http_cfg(0, transport="nixl")
    assert issubclass(E.NixlUnavailable, E.ConfigError) and issubclass(E.NixlUnavailable, E.TractError)
    with pytest.raises(E.ConfigError, match="'http' or 'nixl'"):
        http_cfg(0, transport="rdma")


def test_import_without_nixl_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from tract_async.transport.nixl_env import import_nixl
    monkeypatch.setitem(sys.modules, "nixl", None)       # import nixl now raises ImportError
    with pytest.raises(E.NixlUnavailable, match="not importable.*--no-deps nixl nixl-cu12"):
        import_nixl()


def test_ucx_defaults_without_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    from tract_async.transport import nixl_env as N
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.setattr(N, "cuda_present", lambda: False)
    assert N.apply_ucx_defaults()["UCX_TLS"] == "tcp"
    monkeypatch.delenv("UCX_TLS")
    monkeypatch.setattr(N, "cuda_present", lambda: True)
    assert N.apply_ucx_defaults()["UCX_TLS"] == "tcp,cuda_copy"   # NIXL's UCX refuses VRAM without it
    monkeypatch.setenv("UCX_TLS", "rc,cuda_copy")
    assert N.apply_ucx_defaults()["UCX_TLS"] == "rc,cuda_copy"    # the user's choice stands


def test_layer_hints_only_grow_known_entries_without_nixl() -> None:
    """The NIXL notification channel merges layers into entries the acknowledged channel made,
    and nothing else (``Directory.add_layers``)."""
    d = Directory()
    k = bytes(range(32))
    full = 0b1111

    def p(slot: int, version: int, mask: int) -> list[tuple]:
        return parse_ops([["p", k.hex(), slot, version, format(mask, "x"), mask == full]], full)

    assert d.add_layers("a", p(0, 1, 0b11)) == 0 and k not in d.entries   # never creates
    d.apply("a", p(0, 1, 0b1))
    assert d.add_layers("a", p(0, 1, 0b11)) == 1 and d.entries[k]["a"].mask == 0b11
    assert d.add_layers("a", p(0, 1, 0b01)) == 0 and d.entries[k]["a"].mask == 0b11   # no rewind
    assert d.add_layers("a", p(0, 2, full)) == 0 and not d.entries[k]["a"].complete    # other version
    assert d.add_layers("b", p(0, 1, full)) == 0                                       # other peer
    d.apply("a", p(0, 1, 0b1))        # a reordered announcement of the same reservation: no rewind
    assert d.entries[k]["a"].mask == 0b11
    d.apply("a", [("e", k, 0, 1)])
    assert d.add_layers("a", p(0, 1, full)) == 0 and k not in d.entries                # no resurrection


def test_transfers_are_cut_into_pieces_without_nixl() -> None:
    """Rows split at piece boundaries pair up byte for byte, in order (``nixl_agent._cut``)."""
    from tract_async.transport.nixl_agent import _cut
    local = np.array([[1000, 5, 0], [2000, 9, 0], [3000, 2, 0]], dtype=np.int64)
    remote = np.array([[7000, 5, 1], [8000, 9, 1], [9000, 2, 1]], dtype=np.int64)
    pieces = _cut(local, remote, 4)
    assert [int(p[0][:, 1].sum()) for p in pieces] == [4, 4, 4, 4]
    flat_l = [tuple(r) for p in pieces for r in p[0].tolist()]
    flat_r = [tuple(r) for p in pieces for r in p[1].tolist()]
    assert flat_l == [(1000, 4, 0), (1004, 1, 0), (2000, 3, 0), (2003, 4, 0), (2007, 2, 0),
                      (3000, 2, 0)]
    assert [(a - 6000, n) for a, n, _ in flat_r] == [
        (a, n) for a, n, _ in flat_l]
    assert all(d == 1 for _, _, d in flat_r)
    one = _cut(local, remote, 1 << 20)                  # fits: one piece, rows as given
    assert len(one) == 1 and one[0][0].tolist() == local.tolist()


# -- in one process ------------------------------------------------------------------------------
async def test_layer_readiness_travels_in_nixl_notifications() -> None:
    """Layer 0's acknowledged announcement creates the entries; each later layer wakes the
    waiting consumer through the NIXL notification while its HTTP announcement is held back."""
    a, b = await http_pair()
    gate = asyncio.Event()
    real_call = a._store.agent.call

    async def held_announce(name: str, path: str, payload: Any = None, **kw: Any) -> Any:
        if path == ROUTE_ANNOUNCE:
            await gate.wait()
        return await real_call(name, path, payload, **kw)

    try:
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv[0].contiguous(), layer=0)
        assert torch.equal(await b.get_kv(keys, layer=0), kv[0])
        a._store.agent.call = held_announce                   # HTTP announcements wait now
        for layer in range(1, TINY.num_layers):
            waiter = asyncio.create_task(b.get_kv(keys, layer=layer, timeout=30))
            await asyncio.sleep(0)
            put = asyncio.create_task(a.put_kv(keys, kv[layer].contiguous(), layer=layer))
            assert torch.equal(await asyncio.wait_for(waiter, 30), kv[layer])
            assert not put.done(), "the HTTP announcement was held: the notification woke it"
            gate.set()
            assert await asyncio.wait_for(put, 30) == 4
            gate.clear()
        a._store.agent.call = real_call
        assert b.lookup(keys) == 4 and torch.equal(await b.get_kv(keys), kv)
        sa, sb = a.stats(), b.stats()
        assert sb["transport"] == "nixl" and sb["reads_nixl"] == 5 and sb["reads_http"] == 0
        assert sa["layer_notifs_sent"] == 4            # one per layer put, to its one NIXL peer
        assert sb["layer_notifs_applied"] == 3 * 4 and sb["notifs_refused"] == 0
        assert sb["nixl"]["nixl_peers"] == [a._store.agent.name]
    finally:
        gate.set()
        a._store.agent.call = real_call
        await b.close()
        await a.close()


async def test_round_trips_with_nixls_own_progress_thread() -> None:
    """``nixl_progress_thread=True`` (what the serving workers turn on with 8+ cores): NIXL's
    spinning thread progresses UCX beside the agents' own polling; whole and per-layer gets
    over NIXL are exact, and the agents say the thread is on."""
    a, b = await http_pair(nixl_progress_thread=True)
    try:
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        assert torch.equal(await b.get_kv(keys), kv)
        for layer in range(TINY.num_layers):
            assert torch.equal(await b.get_kv(keys, layer=layer), kv[layer])
        sa, sb = a.stats(), b.stats()
        assert sb["reads_nixl"] == 1 + TINY.num_layers and sb["reads_http"] == 0
        assert sa["nixl"]["progress_thread"] and sb["nixl"]["progress_thread"]
    finally:
        await b.close()
        await a.close()


async def test_staging_in_use_is_bounded_and_reads_wait_their_turn() -> None:
    """``nixl_staging_bytes``: concurrent remote gets stage at most that much at once (one READ
    is always let through); the others wait for room, in order, and every get is exact. With
    the bound below any READ's size, one READ stages at a time; with the default, the same
    gets' READs overlap (the control). A decode worker under load once staged every arriving
    request's whole KV at once in GPU memory and ran out of it."""
    async def six_gets(**kw: Any) -> dict[str, Any]:
        a, b = await http_pair(**kw)
        try:
            sets = [a.block_keys(range(1000 * i, 1000 * i + 16)) for i in range(6)]
            for ks in sets:
                await a.put_kv(ks, kv_for_keys(ks))
            got = await asyncio.gather(*(b.get_kv(ks) for ks in sets))
            for ks, kv in zip(sets, got):
                assert all(block_matches(ks, kv))
            st = b.stats()["nixl"]["staging"]
            assert st["in_use"] == 0, st
            return st
        finally:
            await b.close()
            await a.close()

    one = await six_gets(nixl_staging_bytes=1)
    assert one["reads_max"] == 1 and one["waits"] >= 1, one
    free = await six_gets()
    assert free["reads_max"] >= 2 and free["waits"] == 0, free


async def test_staging_room_times_out_and_gives_back_what_a_cancelled_waiter_got() -> None:
    """``_Staging.room``: a READ that cannot get room within its timeout raises the transport's
    TransferTimeout and leaves no waiter behind; one cancelled just as it was granted hands the
    room on (nothing leaks); an oversized READ alone is let through."""
    from tract_async.stores.nixl import _Staging
    st = _Staging(None, torch.device("cpu"), 0, 1 << 20)     # (room never touches the agent)
    first = await st.room(1 << 20, None)
    with pytest.raises(TE.TransferTimeout, match="no room to stage"):
        await st.room(4096, 0.01)
    assert not st._waiters and st.in_use == 1 << 20
    waiter = asyncio.ensure_future(st.room(4096, 5.0))
    await asyncio.sleep(0)
    st.release(first)                     # grants the waiter ...
    waiter.cancel()                       # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert st.in_use == 0 and not st._waiters     # the grant went back
    big = await st.room(8 << 20, 0.01)    # larger than the bound, alone: let through
    assert st.in_use == 8 << 20
    st.release(big)
    assert st.in_use == 0 and st.in_use_max == 8 << 20 and st.waits == 2


async def test_transport_is_chosen_per_peer() -> None:
    """A NIXL engine and an HTTP engine peer with each other; each reads the other over HTTP."""
    a = await tract.Engine.open(http_cfg(0))                            # nixl
    b = await tract.Engine.open(http_cfg(1, peers=[a.url], transport="http"))
    try:
        ka, kb = a.block_keys(range(48)), b.block_keys(range(500, 548))
        await a.put_kv(ka, kv_for_keys(ka))
        await b.put_kv(kb, kv_for_keys(kb))
        assert all(block_matches(ka, await b.get_kv(ka)))
        assert all(block_matches(kb, await a.get_kv(kb)))
        sa = a.stats()
        assert sa["reads_http"] == 1 and sa["reads_nixl"] == 0 and sa["nixl"]["nixl_peers"] == []
    finally:
        await b.close()
        await a.close()


async def test_timed_out_read_quarantines_its_buffer() -> None:
    """A READ that misses its deadline is reported at once and its destination stays held
    (deregistering it refuses) until the agent closes; a fresh READ into other memory works."""
    from tract_async.transport.descs import XferDescList
    from tract_async.transport.nixl_agent import NixlAgent
    src = torch.full((64 << 20,), 7, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    tgt, ini = NixlAgent("q-target"), NixlAgent("q-initiator", spin_s=0.0)
    info = tgt.register_memory(src, name="src", writable=False)
    ini.register_memory(dst, name="dst")
    await tgt.start()
    await ini.start()
    try:
        peer = ini.add_remote_agent(tgt.get_agent_metadata(), regions=[info])
        x = ini.initialize_xfer("READ", XferDescList([(dst.data_ptr(), src.numel(), 0)]),
                                XferDescList([info.desc()]), peer)
        with pytest.raises(TE.TransferTimeout, match="quarantined"):
            await ini.transfer(x, timeout=1e-4)        # 64 MiB over TCP takes tens of ms
        assert x.quarantined and ini.describe()["quarantined_now"] == 1
        with pytest.raises(TE.TransferInProgress):
            ini.deregister_memory("dst")
        with pytest.raises(TE.HandleReleased):
            await ini.transfer(x, timeout=5)
        small = torch.zeros(4096, dtype=torch.uint8)
        ini.register_memory(small, name="small")
        y = ini.initialize_xfer("READ", XferDescList([(small.data_ptr(), 4096, 0)]),
                                XferDescList([info.desc(0, 4096)]), peer)
        await ini.transfer(y, timeout=30)
        assert int(small.min()) == 7
        y.release()
    finally:
        await ini.close()
        await tgt.close()
    assert ini.describe()["quarantined_now"] == 0     # the worker is gone: nothing can land


async def test_bad_descriptors_get_typed_errors() -> None:
    from tract_async.transport.descs import XferDescList
    from tract_async.transport.nixl_agent import NixlAgent
    src = torch.arange(1 << 16, dtype=torch.int32)
    dst = torch.zeros_like(src)
    n = src.numel() * 4
    tgt, ini = NixlAgent("d-target"), NixlAgent("d-initiator")
    info = tgt.register_memory(src, name="src", writable=False)
    ini.register_memory(dst, name="dst")
    await tgt.start()
    await ini.start()
    try:
        checked = ini.add_remote_agent(tgt.get_agent_metadata(), regions=[info])
        local = XferDescList([(dst.data_ptr(), 4096, 0)])
        with pytest.raises(TE.DescriptorOutOfRange, match="not inside memory"):
            ini.initialize_xfer("READ", local, XferDescList([(info.addr + n - 100, 4096, 0)]), checked)
        with pytest.raises(TE.DescriptorOutOfRange, match="read-only"):
            ini.initialize_xfer("WRITE", local, XferDescList([info.desc(0, 4096)]), checked)
        with pytest.raises(TE.MemoryNotRegistered):
            ini.initialize_xfer("READ", XferDescList([(dst.data_ptr() + n - 10, 4096, 0)]),
                                XferDescList([info.desc(0, 4096)]), checked)
        with pytest.raises(TE.InvalidDescriptors, match="pair up"):
            ini.initialize_xfer("READ", local, XferDescList([info.desc(0, 8192)]), checked)
        with pytest.raises(TE.InvalidOperation):
            ini.initialize_xfer("COPY", local, XferDescList([info.desc(0, 4096)]), checked)
        with pytest.raises(TE.UnknownRemoteAgent):
            ini.initialize_xfer("READ", local, XferDescList([info.desc(0, 4096)]), "nobody")
        # without published ranges NIXL's own check refuses, as the same class
        ini.remove_remote_agent(checked)
        bare = ini.add_remote_agent(tgt.get_agent_metadata())
        with pytest.raises(TE.DescriptorOutOfRange, match="NIXL_ERR_NOT_FOUND"):
            ini.initialize_xfer("READ", local, XferDescList([(info.addr + n, 4096, 0)]), bare)
        x = ini.initialize_xfer("READ", XferDescList([(dst.data_ptr(), n, 0)]),
                                XferDescList([info.desc()]), bare)
        await ini.transfer(x, timeout=30)                 # still serving, bytes exact
        assert torch.equal(dst, src)
        x.release()
    finally:
        await ini.close()
        await tgt.close()


async def test_engine_bad_descriptor_changes_nothing() -> None:
    """A directory entry naming a slot past the peer's pool: a typed error, nothing changed."""
    a, b = await http_pair()
    try:
        keys = a.block_keys(range(32))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv)
        name = a._store.agent.name
        h = b._store.directory[keys[0]][name]
        nslots = a._store.pool.nslots
        b._store._apply(name, [["p", keys[0].hex(), nslots + 5, h.version + 1000, "f", True]])
        before = (a._store.pool.items(), a._store.pool.free_slots)
        with pytest.raises(TE.DescriptorOutOfRange):
            await b.get_kv(keys)
        assert (a._store.pool.items(), a._store.pool.free_slots) == before
        b._store._apply(name, [["p", keys[0].hex(), h.slot, h.version, "f", True]])
        assert torch.equal(await b.get_kv(keys), kv)
    finally:
        await b.close()
        await a.close()


# -- across processes --------------------------------------------------------------------------
def _spawn_producer(pool_bytes: int) -> tuple[Any, Any, Any]:
    from tests.support import procs_nixl
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=procs_nixl.producer, args=(q_out, q_in, pool_bytes), daemon=True)
    proc.start()
    return proc, q_out, q_in


async def _reply(q: Any, timeout: float = 120.0) -> tuple:
    return await asyncio.get_running_loop().run_in_executor(None, lambda: q.get(timeout=timeout))


async def test_cross_process_round_trips_and_layer_streaming() -> None:
    proc, q_out, q_in = _spawn_producer(64 << 20)
    eng = None
    try:
        tag, url, _ = await _reply(q_out)
        assert tag == "up"
        eng = await tract.Engine.open(http_cfg(1, peers=[url]))
        tokens = list(range(16 * 40))                       # 40 blocks, 1.25 MiB
        keys = eng.block_keys(tokens)
        waiting = asyncio.create_task(eng.get_kv(keys, timeout=60))   # before they exist
        await asyncio.sleep(0.05)
        assert not waiting.done()
        q_in.put(("put", tokens))
        assert await _reply(q_out) == ("put", 40, 0)
        got = await asyncio.wait_for(waiting, 60)
        assert all(block_matches(keys, got)) and eng.lookup(keys) == 40
        # layer by layer: the consumer waits for layer i before the producer writes it
        t2 = [t + 7 for t in tokens[:16 * 8]]
        k2 = eng.block_keys(t2)
        for layer in range(TINY.num_layers):
            waiter = asyncio.create_task(eng.get_kv(k2, layer=layer, timeout=60))
            await asyncio.sleep(0.02)
            assert not waiter.done()
            q_in.put(("layer", t2, layer))
            assert (await _reply(q_out))[0] == "layer"
            assert all(block_matches(k2, await asyncio.wait_for(waiter, 60), layer=layer))
        assert eng.lookup(k2) == 8 and all(block_matches(k2, await eng.get_kv(k2)))
        # a large get: 512 blocks, 16 MiB in one READ
        q_in.put(("fill", 100_000, 512))
        assert await _reply(q_out) == ("fill", 512, 0)
        k3 = eng.block_keys(range(100_000, 100_000 + 16 * 512))
        big = await eng.get_kv(k3)
        first = kv_for_keys(k3[:1])
        assert all(torch.equal(big[:, :, j * 16:(j + 1) * 16], first) for j in range(0, 512, 37))
        st = eng.stats()
        assert st["reads_nixl"] >= 7 and st["reads_http"] == 0 and st["validation_failures"] == 0
        q_in.put(("exit",))
        tag, stored, nixl_reads = await _reply(q_out)
        assert tag == "bye" and stored == 40 + 8 + 512
    finally:
        if eng is not None:
            await eng.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


async def test_producer_killed_mid_read_is_a_miss_not_a_hang() -> None:
    proc, q_out, q_in = _spawn_producer(160 << 20)
    eng = None
    try:
        _, url, pid = await _reply(q_out)
        eng = await tract.Engine.open(http_cfg(1, peers=[url], http_pool_bytes=4 << 20))
        q_in.put(("fill", 0, 4096))                          # 128 MiB
        assert await _reply(q_out) == ("fill", 4096, 0)
        keys = eng.block_keys(range(16 * 4096))
        assert eng.lookup(keys) == 4096
        get = asyncio.create_task(eng.get_kv(keys))
        nixl = eng._store.nixl
        async with asyncio.timeout(30):                      # the observed event: READ in flight
            while not nixl._inflight and not get.done():
                await asyncio.sleep(0)
        assert not get.done(), "the 128 MiB READ finished before the kill"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(E.BlockEvicted, match="went away"):
            await asyncio.wait_for(get, 60)
        assert time.monotonic() - t0 < 30
        assert eng.lookup(keys) == 0 and eng.stats()["peers_dropped"] == 1
        mine = eng.block_keys(range(900_000, 900_032))       # the consumer still works
        await eng.put_kv(mine, kv_for_keys(mine))
        assert all(block_matches(mine, await eng.get_kv(mine)))
    finally:
        if eng is not None:
            await eng.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


async def test_agent_peer_killed_mid_transfer() -> None:
    """The transport alone: a bare NixlAgent target SIGKILLed while 128 MiB flow."""
    from tests.support import procs_nixl
    from tract_async.transport.descs import XferDescList
    from tract_async.transport.nixl_agent import NixlAgent
    size = 128 << 20
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=procs_nixl.nixl_target, args=(q, size), daemon=True)
    proc.start()
    agent = NixlAgent("parent")
    dst = np.zeros(size, dtype=np.uint8)
    agent.register_memory(dst, name="dst")
    await agent.start()
    try:
        md, addr, pid = await _reply(q)
        peer = agent.add_remote_agent(md)
        x = agent.initialize_xfer("READ", XferDescList([(dst.ctypes.data, size, 0)]),
                                  XferDescList([(addr, size, 0)]), peer)
        t = asyncio.create_task(agent.transfer(x, timeout=60))
        async with asyncio.timeout(30):                     # bytes are flowing
            while dst[1 << 20] != 0xAB and not t.done():
                await asyncio.sleep(0)
        assert not t.done()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TE.PeerDisconnected):
            await asyncio.wait_for(t, 60)
        assert dst[-1] != 0xAB, "the whole READ landed before the kill"
        assert not x.quarantined and not agent.registry.in_use("dst")   # settled: reusable
        x.release()
    finally:
        await agent.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- CUDA (written for the H200; skipped without a GPU) ------------------------------------------
@pytest.mark.gpu
async def test_gpu_pool_round_trip() -> None:
    a, b = await http_pair(nixl_pool_device="cuda")
    try:
        assert a._store.takes_cuda and a._store.pool.bytes.is_cuda
        keys = a.block_keys(range(64))
        kv = kv_for_keys(keys)
        await a.put_kv(keys, kv.cuda())                   # CUDA in, straight to the GPU pool
        got = await b.get_kv(keys, device="cuda")         # a NIXL READ VRAM -> VRAM
        assert got.is_cuda and torch.equal(got.cpu(), kv)
        assert torch.equal(await b.get_kv(keys), kv)      # CPU out from a GPU pool
        for layer in range(TINY.num_layers):
            out = torch.empty_like(kv[layer]).cuda()
            await b.get_kv(keys, layer=layer, out=out)
            assert torch.equal(out.cpu(), kv[layer])
        assert b.stats()["reads_nixl"] >= 2 + TINY.num_layers
    finally:
        await b.close()
        await a.close()
