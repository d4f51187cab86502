"""Copies before the entries (``stores/txn.py``, ``EarlyCopies``; docs/design.md, "Copies
before the entries").

A lock-free reservation of many new blocks hands the put's copy back-end the payload offsets
between taking the slots and placing the index entries, so that an asynchronous copy (the CUDA
DMA) runs while the entries are written. The contract, checked here on the CPU with a copy
back-end that writes the region by those offsets at once (numpy into the mapping):

- ``start`` comes before any entry of the put exists, with the offsets the keys end up with
  (key order), and the bytes copied there are what a read of the published blocks returns;
- a placement that is not whole (a key another node reserved after this node's snapshot)
  voids the copies before the reservation returns, and the put then copies again by what the
  reservation became; the other node's block is untouched;
- a put that cannot be served lock-free (the first put takes the lane under the lock) starts
  no early copies;
- a back-end whose start raises leaves nothing reserved and every slot back on the free lists.

The CUDA back-end (``cuda/store.py``, ``_EarlyPut``) is checked on a GPU by
``tests/cuda/test_early_copies_gpu.py``.
"""
from __future__ import annotations

import hashlib

import numpy as np

import tract_async as tract
from tract_async.keys import keys_to_words
from tract_async.region.index import SNAP_SLOT
from tract_async.stores import plan as kvplan
from tract_async.stores.txn import PutTxn
from tests.support.engine_util import TINY, block_matches, cfg, free_slots, kv_for_keys, np_out


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


class CpuEarly:
    """A copy back-end that copies whole blocks of ``kv`` into the region at ``start``."""

    def __init__(self, eng: tract.Engine, keys: list[bytes], kv: np.ndarray) -> None:
        self.eng, self.keys, self.kv = eng, keys, kv
        self.started = False
        self.offsets: np.ndarray | None = None
        self.entries_at_start: int | None = None
        self.voids = 0

    def start(self, offsets: np.ndarray) -> None:
        b = self.eng._store.blocks
        snap = b.index.snapshot(keys_to_words(self.keys))
        self.entries_at_start = int((snap[:, SNAP_SLOT] >= 0).sum())
        n = len(self.keys)
        rows = kvplan.plan(TINY, offsets, np.arange(n), n, None)
        region = np.frombuffer(self.eng.region.buf, dtype=np.uint8)
        src = self.kv.reshape(-1).view(np.uint8)
        for r_off, t_off, nb in rows.tolist():
            region[r_off:r_off + nb] = src[t_off:t_off + nb]
        self.offsets = offsets.copy()
        self.started = True

    def void(self) -> None:
        self.voids += 1
        self.started = False


def _region_kv(eng: tract.Engine, txn: PutTxn, kv: np.ndarray) -> int:
    """The ordinary copy of a put's ``todo`` blocks (what the put does after a void)."""
    n = len(txn.keys)
    rows = kvplan.plan(TINY, txn.offsets(), txn.positions(), n, None)
    region = np.frombuffer(eng.region.buf, dtype=np.uint8)
    src = kv.reshape(-1).view(np.uint8)
    for r_off, t_off, nb in rows.tolist():
        region[r_off:r_off + nb] = src[t_off:t_off + nb]
    return int(rows[:, 2].sum())


async def _warm(eng: tract.Engine, tag: str, n: int) -> None:
    """Take the lane and enough chunks (under the lock), then give the slots back (a transfer
    read frees what it read whole): later puts of up to ``n`` blocks reserve lock-free."""
    warm = _keys(tag, n)
    await eng.put_kv(warm, kv_for_keys(warm, as_numpy=True))
    await eng.get_kv(warm, out=np_out(warm))


async def test_early_copies_land_where_the_entries_point(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=64 << 20,
                                     mode="transfer")) as eng:
        b, st = eng._store.blocks, eng._store.stats
        # the first put takes the lane and claims chunks under the lock: no early copies
        first = _keys("first", 40)
        kv0 = kv_for_keys(first, as_numpy=True)
        e0 = CpuEarly(eng, first, kv0)
        txn0 = PutTxn(b, first, None, 5.0, "test", early=e0)
        assert await txn0.begin()
        assert e0.offsets is None and e0.voids == 0 and st.early_copies == 0
        assert txn0.publish(_region_kv(eng, txn0, kv0)) == len(first)
        out0 = np_out(first)
        await eng.get_kv(first, out=out0)         # consumed: its slots are free again
        assert all(block_matches(first, out0))
        # now lock-free: the copies start before the entries, at the offsets they end up with
        keys = _keys("early", 40)
        kv = kv_for_keys(keys, as_numpy=True)
        e = CpuEarly(eng, keys, kv)
        txn = PutTxn(b, keys, None, 5.0, "test", early=e)
        assert await txn.begin()
        assert e.entries_at_start == 0, "the copies must start before any entry is placed"
        assert st.early_copies == 1 and e.voids == 0
        assert txn.whole() and np.array_equal(e.offsets, txn.offsets())
        # publish what the early copies wrote; the ordinary read returns it
        assert txn.publish(len(keys) * TINY.block_bytes) == len(keys)
        out = np_out(keys)
        await eng.get_kv(keys, out=out)
        assert all(block_matches(keys, out))


async def test_a_placement_that_is_not_whole_voids_the_early_copies(region_path: str) -> None:
    big = 64 << 20
    async with tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=big,
                                     mode="transfer")) as a, \
            tract.Engine.open(cfg(region_path, 1, region_bytes=big, mode="transfer")) as other:
        keys = _keys("partial", 80)
        kv = kv_for_keys(keys, as_numpy=True)
        await _warm(a, "warm-a", 100)
        # the other node stores key 7 after a's last put: a's put of 80 keys skips its snapshot
        # (no put of a's found anything present yet), so its reservation meets key 7 only in
        # the index, after the copies started
        theirs = [keys[7]]
        assert await other.put_kv(theirs, kv_for_keys(theirs, as_numpy=True)) == 1
        b, st = a._store.blocks, a._store.stats
        e = CpuEarly(a, keys, kv)
        txn = PutTxn(b, keys, None, 5.0, "test", early=e)
        assert await txn.begin()
        assert e.offsets is not None, "the reservation should have started the copies"
        assert e.voids == 1 and st.early_copies_voided == 1 and st.early_copies == 0
        assert len(txn.todo) == len(keys) - 1 and 7 not in list(txn.todo)
        nbytes = _region_kv(a, txn, kv)             # the put copies again, by its reservations
        assert txn.publish(nbytes) == len(keys) - 1
        mine = [k for i, k in enumerate(keys) if i != 7]
        out = np_out(mine)
        await a.get_kv(mine, out=out)
        assert all(block_matches(mine, out))
        out7 = np_out(theirs)
        await other.get_kv(theirs, out=out7)
        assert all(block_matches(theirs, out7))


class FailingEarly(CpuEarly):
    """A copy back-end whose start fails (what a driver error raising out of it would do)."""

    def start(self, offsets: np.ndarray) -> None:
        raise RuntimeError("the copy back-end failed to start")


async def test_a_failing_early_start_reserves_nothing_and_gives_the_slots_back(
        region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, region_bytes=64 << 20,
                                     mode="transfer")) as eng:
        await _warm(eng, "warm-f", 60)
        b = eng._store.blocks
        keys = _keys("failing", 40)
        kv = kv_for_keys(keys, as_numpy=True)
        room = free_slots(eng)
        txn = PutTxn(b, keys, None, 5.0, "test", early=FailingEarly(eng, keys, kv))
        try:
            await txn.begin()
        except RuntimeError as e:
            assert "failed to start" in str(e)
        else:
            raise AssertionError("the reservation swallowed the copy back-end's error")
        assert free_slots(eng) == room and eng.lookup(keys) == 0
        # the same keys put the ordinary way: exact
        assert await eng.put_kv(keys, kv) == len(keys)
        out = np_out(keys)
        await eng.get_kv(keys, out=out)
        assert all(block_matches(keys, out))
