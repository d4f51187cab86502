"""Doorbells (``stores/doorbell.py``): a wait on the region is woken by the producer's datagram,
each of the two flush sites of the race is needed, and a lost ring costs a timer round, never
a hang.

The site tests run under the incoherent backend with evictions off (``ctl`` threshold 0): a
line leaves a node's private cache only through a flush, so a skipped site shows
deterministically, not by chance.
"""
from __future__ import annotations

import asyncio
import mmap
import multiprocessing as mp
import socket

import numpy as np
import pytest

import tract_async as tract
import tract_kernels as K
from tests.support.engine_util import block_matches, cfg, kv_for_keys, np_out
from tract_async.region import layout as L
from tract_async.stores import doorbell as db

SPAWN = mp.get_context("spawn")


# -- the race, kernel by kernel ----------------------------------------------------------------

@pytest.fixture
def buf() -> np.ndarray:
    mm = mmap.mmap(-1, 1 << 16)
    return np.frombuffer(mm, dtype=np.uint8)


def _race(consumer: K.Mem, producer: K.Mem, nodes: int = 4) -> int:
    """The producer looks once (caching every line), node 2 says it waits, the producer looks
    again: the mask it returns."""
    assert db.waiting_mask(producer, 0, nodes) == 0
    db.set_waiting(consumer, 2 * L.LINE_BYTES, 1, 7)
    return int(db.waiting_mask(producer, 0, nodes))


@pytest.mark.parametrize("backend", ["hw", "sim"])
def test_a_waiting_node_is_seen_with_every_site(buf: np.ndarray, backend: str) -> None:
    c = K.make_mem(buf, backend, seed=1, evict_prob=0.0)
    p = K.make_mem(buf, backend, seed=2, evict_prob=0.0)
    assert _race(c, p) == 1 << 2


def test_without_the_consumers_flush_the_producer_never_sees_it(buf: np.ndarray) -> None:
    c = K.make_mem(buf, "sim", seed=1, evict_prob=0.0, skip_site=db.S_DB_FLUSH)
    p = K.make_mem(buf, "sim", seed=2, evict_prob=0.0)
    assert _race(c, p) == 0


def test_without_the_producers_invalidate_it_reads_a_stale_line(buf: np.ndarray) -> None:
    c = K.make_mem(buf, "sim", seed=1, evict_prob=0.0)
    p = K.make_mem(buf, "sim", seed=2, evict_prob=0.0, skip_site=db.S_DB_READ)
    assert _race(c, p) == 0


def test_the_sites_are_named() -> None:
    assert set(K.registered("doorbell.")) == {"doorbell.waiting.flush",
                                              "doorbell.waiting.invalidate"}


# -- the race, through two engines (two nodes, two private caches) -----------------------------

def _no_evictions(eng: tract.Engine, skip_site: int = -1) -> None:
    """The loop thread's sim cache of this node keeps every line until a flush writes it."""
    r = eng._region
    m = r.mem
    K.mem_state(m).ctl[1] = 0
    r.mem = K.with_skip_site(m, skip_site)


async def _handoff(prod: tract.Engine, cons: tract.Engine, tokens: list[int],
                   on_doorbell: bool = True) -> None:
    keys = cons.block_keys(tokens)
    out = np_out(keys)
    waiting = asyncio.create_task(cons.get_kv(keys, out=out, timeout=20.0))
    if on_doorbell:
        for _ in range(50):               # the consumer registered its wait
            await asyncio.sleep(0.002)
            if cons._store.blocks.doorbell._waits:
                break
        assert cons._store.blocks.doorbell._waits, "the consumer never waited"
    else:
        await asyncio.sleep(0.05)
        assert not cons._store.blocks.doorbell._waits
    await prod.put_kv(keys, kv_for_keys(keys, as_numpy=True))
    got = await waiting
    assert all(block_matches(keys, got))


@pytest.mark.parametrize("skip", [None, "doorbell.waiting.flush", "doorbell.waiting.invalidate"])
async def test_engines_wake_by_the_doorbell_only_with_both_sites(
        region_path: str, skip: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With both sites, the consumer's wait ends on the producer's ring. Without either, no
    ring is sent and the wait still ends, on its timer (``doorbell_wakes`` stays 0). The
    timer's first round is stretched to 0.3 s: a slow put (the sim backend on a busy host)
    must not let the timer find the block before the ring does."""
    monkeypatch.setattr(db, "SAFETY_FIRST_S", 0.3)
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as prod, \
            tract.Engine.open(cfg(region_path, 1, backend="sim")) as cons:
        site = -1 if skip is None else K.registered("doorbell.")[skip]
        _no_evictions(prod, site if skip == "doorbell.waiting.invalidate" else -1)
        _no_evictions(cons, site if skip == "doorbell.waiting.flush" else -1)
        # the producer caches every doorbell line (all idle) with a first publish
        warm = prod.block_keys(list(range(1000, 1016)))
        await prod.put_kv(warm, kv_for_keys(warm, as_numpy=True))
        pbell, cbell = prod._store.blocks.doorbell, cons._store.blocks.doorbell
        assert pbell.receiving and cbell.receiving
        for round_ in range(3):
            await _handoff(prod, cons, list(range(16 * 4 * round_, 16 * 4 * (round_ + 1))))
        wakes = cons.stats()["doorbell_wakes"]
        if skip is None:
            assert pbell.rings_sent >= 3 and cbell.rings_received >= 3
            assert wakes >= 3
        else:
            assert pbell.rings_sent == 0 and cbell.rings_received == 0
            assert wakes == 0
        assert not cbell._waits                 # every wait deregistered


async def test_a_lost_ring_costs_a_timer_round(region_path: str) -> None:
    """A producer without a doorbell (its socket closed) rings nobody: the consumer's wait
    still ends, found by its safety timer."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod, \
            tract.Engine.open(cfg(region_path, 1)) as cons:
        prod._store.stop_waking()
        await _handoff(prod, cons, list(range(64)))
        assert cons.stats()["doorbell_wakes"] == 0
        assert prod._store.blocks.doorbell.rings_sent == 0


async def test_a_node_without_a_doorbell_polls(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod, \
            tract.Engine.open(cfg(region_path, 1)) as cons:
        cons._store.stop_waking()
        await _handoff(prod, cons, list(range(64)), on_doorbell=False)
        assert cons.stats()["doorbell_wakes"] == 0
        assert prod._store.blocks.doorbell.rings_sent == 0   # its line says it does not wait


async def test_a_layer_wait_is_woken_per_layer(region_path: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's publish rings the waiting consumer. The timer's first round is stretched
    to 0.3 s, as in the test above: producer and consumer share this loop, and a safety timer
    that expired during the put runs in the same loop iteration as the put's step, finds the
    layer, and ends the wait before the ring's callback (1 run in ~5 failed so, before and
    after the fused path)."""
    monkeypatch.setattr(db, "SAFETY_FIRST_S", 0.3)
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod, \
            tract.Engine.open(cfg(region_path, 1)) as cons:
        keys = cons.block_keys(list(range(64)))
        kv = kv_for_keys(keys, as_numpy=True)
        for layer in range(kv.shape[0]):
            out = np_out(keys, layer=layer)
            waiting = asyncio.create_task(cons.get_kv(keys, layer=layer, out=out, timeout=20.0))
            await asyncio.sleep(0.01)
            await prod.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
            got = await waiting
            assert all(block_matches(keys, got, layer=layer))
        assert cons.stats()["doorbell_wakes"] >= kv.shape[0]


def _remote_producer(path: str, tokens: list[int], go, done) -> None:  # noqa: ANN001
    async def main() -> None:
        async with tract.Engine.open(cfg(path, 1)) as eng:
            keys = eng.block_keys(tokens)
            kv = kv_for_keys(keys, as_numpy=True)
            go.wait(60)
            await eng.put_kv(keys, kv)
            done.set()
            await asyncio.sleep(0.2)
    tract.run(main())


async def test_cross_process_wait_is_woken_by_the_doorbell(region_path: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The consumer's safety timer re-checks far later than the producer can take: only the
    # producer's datagram can end this wait in time. With the default 1-20 ms timer, a CI run
    # under load once had the timer find the block between the producer's publish and its
    # datagram (doorbell_wakes 0, the block read fine): a race the assertion was not about.
    monkeypatch.setattr(db, "SAFETY_FIRST_S", 30.0)
    monkeypatch.setattr(db, "SAFETY_MAX_S", 30.0)
    tokens = list(range(128))
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as cons:
        go, done = SPAWN.Event(), SPAWN.Event()
        p = SPAWN.Process(target=_remote_producer, args=(region_path, tokens, go, done))
        p.start()
        try:
            keys = cons.block_keys(tokens)
            waiting = asyncio.create_task(cons.get_kv(keys, out=np_out(keys), timeout=60.0))
            await asyncio.sleep(0.05)
            go.set()
            got = await waiting
            assert all(block_matches(keys, got))
            assert cons.stats()["doorbell_wakes"] >= 1
            assert cons._store.blocks.doorbell.rings_received >= 1
        finally:
            await asyncio.get_running_loop().run_in_executor(None, p.join, 60)
            if p.is_alive():
                p.kill()
        assert p.exitcode == 0


async def test_the_socket_name_is_free_after_close(region_path: str) -> None:
    """Nothing left behind: the abstract name goes with the socket (no file anywhere)."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        name = db._name(eng._region, 0)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with pytest.raises(OSError):
                probe.bind(name)            # held by the open engine
        finally:
            probe.close()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.bind(name)                    # released by close
    finally:
        probe.close()


async def test_a_new_incarnation_clears_a_stale_waiting_line(region_path: str) -> None:
    """A node killed while it waited leaves its line saying so; the next engine of that node id
    clears it when its doorbell starts (producers stop ringing a socket nobody reads)."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        bell = eng._store.blocks.doorbell
        line = bell.offset + 1 * L.LINE_BYTES
        db.set_waiting(eng._region.mem, line, 1, 99)         # node 1 "died waiting"
        assert db.waiting_mask(eng._region.mem, bell.offset, bell.max_nodes) == 1 << 1
        async with tract.Engine.open(cfg(region_path, 1)):
            assert db.waiting_mask(eng._region.mem, bell.offset, bell.max_nodes) == 0


async def test_rings_for_other_keys_cost_one_lookup(region_path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A read waiting for a layer of its blocks is rung by every publication on the host; while
    one of its keys still lacks the layer, a ring costs a lookup of that key only (the probe),
    and the wait still ends with the right bytes once its own layer is published."""
    monkeypatch.setattr(db, "SAFETY_FIRST_S", 5.0)     # no timer's look during the test
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod, \
            tract.Engine.open(cfg(region_path, 1)) as cons:
        keys = cons.block_keys(list(range(16 * 6)))
        kv = kv_for_keys(keys, as_numpy=True)
        await prod.put_kv(keys, np.ascontiguousarray(kv[0]), layer=0)   # present, layer 1 not
        out = np_out(keys, layer=1)
        waiting = asyncio.create_task(cons.get_kv(keys, layer=1, out=out, timeout=20.0))
        await asyncio.sleep(0.05)
        before = cons.stats()["doorbell_probe_skips"]
        others = 8
        for i in range(others):                        # publications of other keys ring it
            ok = prod.block_keys(list(range(10_000 + 16 * i, 10_000 + 16 * (i + 1))))
            await prod.put_kv(ok, kv_for_keys(ok, as_numpy=True))
            await asyncio.sleep(0.01)
        assert not waiting.done()
        skips = cons.stats()["doorbell_probe_skips"] - before
        assert skips >= others - 1, skips              # (a ring may cover two publications)
        wakes = cons.stats()["doorbell_wakes"]
        await prod.put_kv(keys, np.ascontiguousarray(kv[1]), layer=1)
        got = await asyncio.wait_for(waiting, 2)      # by the ring, long before the 5 s timer
        assert all(block_matches(keys, got, layer=1))
        assert cons.stats()["doorbell_wakes"] == wakes + 1
