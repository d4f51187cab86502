"""The index and the allocator must agree, and when they do not, a get must still never return
another block's bytes (issue: ``fsck --repair`` reclaimed a dead node's chunks without dropping
its index entries, so its keys stayed hits and, once the slots were reused, gets returned other
blocks' bytes).

* ``fsck --repair`` drops a dead node's entries with its chunks, offline and with a live node
  attached (online);
* ``fsck`` reports entries that point at free slots, at dead nodes' chunks, or at slots reused
  by another reservation, and ``--repair`` removes them;
* the whole class: entries made stale on purpose (their slots freed behind the index's back and
  reused) read as misses, never as wrong bytes; with the slot-tag check switched off (the
  negative control) the same reads return the new occupant's bytes.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest

import tract_async as tract
import tract_kernels as K
from tract_async import errors as E
from tract_async.keys import keys_to_words
from tract_async.region import index as ix
from tract_async.tools.fsck import run_fsck
from tests.support import procs_engine as P
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys

SPAWN = mp.get_context("spawn")
LIVENESS_S = 1.0
DEAD_IDS = list(range(16 * 64))          # 64 blocks of 32 KiB: two 1 MiB chunks of node 0
NEW_IDS = [100_000 + t for t in DEAD_IDS]


async def _qget(q, timeout: float = 120.0):  # noqa: ANN001, ANN202
    return await asyncio.get_running_loop().run_in_executor(None, q.get, True, timeout)


async def _dead_producer(path: str, backend: str) -> None:
    """Node 0 creates the region, stores DEAD_IDS, and is killed (-9) holding everything."""
    q = SPAWN.Queue()
    p = SPAWN.Process(target=P.put_then_hang, args=(path, backend, 0, DEAD_IDS, True, q))
    p.start()
    try:
        kind, node, resident = await _qget(q)
        assert (kind, node, resident) == ("stored", 0, len(DEAD_IDS) // TINY.block_tokens)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        await asyncio.get_running_loop().run_in_executor(None, p.join, 30)
    await asyncio.sleep(LIVENESS_S * 1.6)    # node 0's heartbeat is now stale


async def _fsck(path: str, repair: bool = False):  # noqa: ANN202
    # in a thread: an online repair runs its own event loop (asyncio.run)
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: run_fsck(path, repair=repair, liveness_timeout_s=LIVENESS_S))


async def _no_stale_hits_after_reuse(eng: tract.Engine) -> None:
    """The dead node's keys are gone, and after their slots are reused, no get of them returns
    bytes (let alone the new blocks' bytes)."""
    dead = eng.block_keys(DEAD_IDS)
    assert eng.lookup(dead) == 0, "the dead node's entries survived the repair"
    new = eng.block_keys(NEW_IDS)
    await eng.put_kv(new, kv_for_keys(new))                  # reuses the reclaimed chunks
    assert all(block_matches(new, await eng.get_kv(new)))
    for i in range(0, len(dead), 8):
        with pytest.raises((E.BlockNotFound, E.BlockEvicted)):
            await eng.get_kv(dead[i:i + 8])


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_offline_repair_drops_a_dead_nodes_entries(region_path: str, backend: str) -> None:
    await _dead_producer(region_path, backend)
    before = await _fsck(region_path)
    assert any("dead node 0" in p and p.startswith("index:") for p in before.problems), \
        before.text()
    rep = await _fsck(region_path, repair=True)               # nobody live: offline repair
    assert rep.repaired and rep.clean, rep.text()
    assert any("dropped its 64 index entries" in r for r in rep.repairs), rep.text()
    async with tract.Engine.open(cfg(region_path, 1, backend=backend)) as eng:
        await _no_stale_hits_after_reuse(eng)
    assert (await _fsck(region_path)).clean


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_online_repair_drops_a_dead_nodes_entries(region_path: str, backend: str) -> None:
    q = SPAWN.Queue()
    p = SPAWN.Process(target=P.put_then_hang, args=(region_path, backend, 0, DEAD_IDS, True, q))
    p.start()
    try:
        assert (await _qget(q))[0] == "stored"
        async with tract.Engine.open(cfg(region_path, 1, backend=backend)) as eng:
            # what fsck repairs here, node 1's maintenance (it takes the manager role) would
            # reclaim on its own within a few liveness timeouts: held off, fsck is the repairer
            eng._store.blocks.reclaims_dead = lambda: False
            os.kill(p.pid, signal.SIGKILL)
            await asyncio.get_running_loop().run_in_executor(None, p.join, 30)
            await asyncio.sleep(LIVENESS_S * 1.6)
            rep = await _fsck(region_path, repair=True)      # node 1 is live: online repair
            assert rep.repaired and rep.clean, rep.text()
            assert any("joined as node" in n for n in rep.notes), rep.text()
            await _no_stale_hits_after_reuse(eng)
            assert (await _fsck(region_path)).clean
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)


def _free_behind_the_index(eng: tract.Engine, keys: list[bytes]) -> int:
    """Free the slots that the entries of ``keys`` own in the allocator without touching the
    entries: the disagreement the slot tags must make harmless. Returns how many it freed. The
    node's spare slots (``blocks.py``) go back to the free lists first, so that its next put
    takes exactly these freed slots: the reuse the scenarios here are about.

    An entry owns its slot while the slot's tag names it (entry and version, ``index.tag_value``),
    as the readers' check has it. An entry this helper made stale before owns nothing: the
    lookups that choose the keys count it as a hit, but its slot was freed and is now free,
    one of the node's spares (a put smaller than the one it replaced leaves the rest of the
    freed slots there) or another block's. Freeing it again would be a double free (the
    allocator's AllocationInvalid; a spare is freed once by ``drop_spares`` just above) or would
    free another block's slot; such an entry is skipped: it is stale already."""
    st = eng._store
    st.blocks.drop_spares()
    snap = st.index.snapshot(keys_to_words(keys))
    assert (snap[:, 0] >= 0).all(), "a key to free has no entry"
    table = st.index.scan()
    g, mem = st.alloc.geo, st.alloc._region.mem
    allocs = []
    for s, version in snap[:, :2].tolist():
        if int(K.load_fresh(mem, g.tag_off(int(table[s, 1])), K.NO_SITE)) != \
                ix.tag_value(s, version):
            continue                      # stale already: its slot is not its own to free
        allocs.append(st.blocks.allocation_of(int(table[s, 1]), int(table[s, 2]),
                                              int(table[s, 6]), int(table[s, 7])))
    st.alloc.free_many(allocs)
    return len(allocs)


async def test_entry_at_a_freed_slot_is_a_miss_and_closes_cleanly(region_path: str) -> None:
    """A slot freed behind the index and not yet reused: its tag is zeroed with the free, so
    the entry reads as a miss, and evicting it (the close evicts all of a node's blocks) drops
    it without freeing the slot a second time. The clean-up at close once raised
    AllocationInvalid ("double free") here, because the freed slot still carried the entry's
    tag."""
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, backend="sim"))
    try:
        a = eng.block_keys(range(16 * 8))
        await eng.put_kv(a, kv_for_keys(a))
        assert _free_behind_the_index(eng, a[:4]) == 4
        table = eng._store.index.scan()
        snap = eng._store.index.snapshot(keys_to_words(a[:4]))
        g = eng._store.alloc.geo
        mem = eng._store.alloc._region.mem
        for s in snap[:, 0].tolist():
            assert int(K.load_fresh(mem, g.tag_off(int(table[s, 1])), K.NO_SITE)) == 0
        assert eng.lookup(a[:4]) == 4            # the index still holds the entries
        with pytest.raises((E.BlockNotFound, E.BlockEvicted)):
            await eng.get_kv(a[:4])              # but they read as a miss
        assert all(block_matches(a[4:], await eng.get_kv(a[4:])))
    finally:
        await eng.close()                  # evicts the stale entries: must not double-free


async def test_fsck_reports_and_repairs_entries_at_free_and_reused_slots(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as eng:
        a = eng.block_keys(range(16 * 8))
        await eng.put_kv(a, kv_for_keys(a))
        assert (await _fsck(region_path)).clean
        assert _free_behind_the_index(eng, a[:4]) == 4
        rep = await _fsck(region_path)
        free = [p for p in rep.problems if "which is free" in p]
        assert len(free) == 4, rep.text()
        b = eng.block_keys(range(50_000, 50_000 + 16 * 4))
        await eng.put_kv(b, kv_for_keys(b))                  # takes the 4 freed slots
        rep = await _fsck(region_path)
        reused = [p for p in rep.problems if "names another reservation" in p]
        assert len(reused) == 4 and len(rep.problems) == 4, rep.text()
        rep = await _fsck(region_path, repair=True)
        assert rep.clean, rep.text()
        assert sum("tombstoned index entry" in r for r in rep.repairs) == 4, rep.text()
        assert eng.lookup(a) == 0 and eng.lookup(a[4:]) == len(a) - 4
        assert all(block_matches(b, await eng.get_kv(b)))
        assert all(block_matches(a[4:], await eng.get_kv(a[4:])))


@pytest.mark.parametrize("tags", [True, False], ids=["tagged", "negative-control"])
async def test_a_stale_entry_at_a_reused_slot_is_a_miss(region_path: str, tags: bool) -> None:
    """Deterministic: X's slot is freed behind the index and Y is written into it. A get of X
    must be a miss; without the tag check (negative control) it returns Y's bytes as X's."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as eng:
        x = eng.block_keys(range(16))
        await eng.put_kv(x, kv_for_keys(x))
        x_payload = int(eng._store.index.snapshot(keys_to_words(x))[0, 3])
        assert _free_behind_the_index(eng, x) == 1
        y = eng.block_keys(range(7000, 7016))
        await eng.put_kv(y, kv_for_keys(y))
        assert int(eng._store.index.snapshot(keys_to_words(y))[0, 3]) == x_payload
        assert eng.lookup(x) == 1, "the stale entry must still look like a hit"
        if not tags:
            real = eng._store.index.tgeo
            eng._store.index.tgeo = real.copy()
            eng._store.index.tgeo[ix.TG_TAGS] = -1
            try:
                got = await eng.get_kv(x)
            finally:       # the close below evicts X and Y: it must know X's slot is not X's
                eng._store.index.tgeo = real
            assert all(block_matches(y, got)), "expected Y's bytes handed out as X's"
            return
        with pytest.raises(E.BlockEvicted):
            await eng.get_kv(x)


async def test_freeing_a_stale_prompt_again_frees_nothing(region_path: str) -> None:
    """The stress below frees a prompt's slots behind the index whenever the prompt looks
    resident, and a stale prompt looks resident (its entries are hits until evicted or
    repaired). Here X (4 blocks) is made stale and Y (1 block) takes one of its slots; the other
    three stay free or become the node's spares. Freeing X's slots again must free none of
    them: not Y's, and not a free or spare one. The helper once freed every slot an entry of X
    named: a double free (AllocationInvalid) for a spare, which ``drop_spares`` had just freed
    -- the stress met it in every run once small batches were paired in ascending payload
    order (blocks.py ``_place``), which changes only which slots are left over -- or, where
    every such slot happened to be reused, a free of live blocks' slots."""
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim")) as eng:
        x = eng.block_keys(range(16 * 4))
        await eng.put_kv(x, kv_for_keys(x))
        assert _free_behind_the_index(eng, x) == 4
        y = eng.block_keys(range(7000, 7016))
        await eng.put_kv(y, kv_for_keys(y))                  # one of X's freed slots
        assert eng.lookup(x) == 4 and eng.lookup(y) == 1     # X's stale entries are hits
        assert _free_behind_the_index(eng, x) == 0
        assert all(block_matches(y, await eng.get_kv(y)))    # Y's slot was left alone
        with pytest.raises((E.BlockNotFound, E.BlockEvicted)):
            await eng.get_kv(x)


STRESS_S = float(os.environ.get("TRACT_DISAGREE_S", "12"))
"""The long form's seconds (``slow``)."""
STRESS_ROUNDS = 250
"""Node 0's rounds in the CI form: a count, so that a slow or loaded machine does the same
work, not less."""


async def test_disagreement_stress_zero_wrong_bytes(region_path: str) -> None:
    """The CI form: STRESS_ROUNDS rounds of node 0."""
    await _disagreement_stress(region_path, STRESS_ROUNDS)


@pytest.mark.slow
async def test_disagreement_stress_zero_wrong_bytes_long(region_path: str) -> None:
    """The long form: STRESS_S seconds (default 12)."""
    await _disagreement_stress(region_path, STRESS_S)


async def _disagreement_stress(region_path: str, budget: float | int) -> None:
    """Node 0 keeps making stale entries on purpose (stores a prompt, frees its slots behind
    the index, stores another prompt into them) while two reader processes get random prompts,
    stale or not, under the incoherent backend. Every read is bit-exact or a miss. ``budget``:
    a float is seconds of wall time, an int a count of node 0's rounds."""
    by_count = isinstance(budget, int)
    universe = 48
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim",
                                     region_bytes=8 << 20, chunk_bytes=256 << 10)) as eng:
        q, stop = SPAWN.Queue(), SPAWN.Event()
        stale = SPAWN.Value("i", -1)          # the prompt made stale last: readers aim at it
        readers = [SPAWN.Process(target=P.reader_worker,
                                 args=(region_path, "sim", n, universe, 200 + n, q, stop, stale))
                   for n in (1, 2)]
        for r in readers:
            r.start()
        rnd = random.Random(7)
        prompts = [eng.block_keys([p * 1000 + t for t in range(16 * (1 + p % 4))])
                   for p in range(universe)]
        made_stale = 0
        try:
            for _ in readers:
                assert (await _qget(q))[0] == "ready"
            t_end = time.monotonic() + (0 if by_count else budget)
            rounds = 0
            while rounds < budget if by_count else time.monotonic() < t_end:
                rounds += 1
                ia, ib = rnd.sample(range(universe), 2)
                a, b = prompts[ia], prompts[ib]
                try:
                    if eng.lookup(a) < len(a):
                        await eng.put_kv(a, kv_for_keys(a))
                    if eng.lookup(a) == len(a) and eng.lookup(b) == 0:
                        freed = _free_behind_the_index(eng, a)   # < len(a): a stale already
                        await eng.put_kv(b, kv_for_keys(b))
                        made_stale += freed
                        stale.value = ia
                        await asyncio.sleep(0.05)     # let the readers meet it
                except (E.RegionFull, E.TransferTimeout):
                    pass
                if rnd.random() < 0.03:       # clean up some stale entries the honest way
                    await _fsck(region_path, repair=True)
                await asyncio.sleep(0)
        finally:
            stop.set()
            results = []
            for _ in readers:
                kind, node, res = await _qget(q, timeout=120)
                assert kind == "result", f"node {node}: {res}"
                results.append(res)
            for r in readers:
                r.join(30)
        total = {k: sum(r[k] for r in results) for k in results[0]}
        print("disagreement stress:", total, "stale blocks made:", made_stale, "rounds:", rounds)
        assert total["wrong_blocks"] == 0
        assert made_stale > 50 and total["gets_ok"] > 20 and total["misses"] > 0
        assert total["tag_misses"] > 0, "no read ever met a reused slot: the stress proved nothing"
