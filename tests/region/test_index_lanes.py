"""Index lanes (``region/index.py``, "Who writes what"): each node reserves, publishes and
abandons in its own lane without the global lock, a lock holder evicts READY entries of any
lane, and every flush and invalidate of those steps is needed.

The site tests run the kernels of two or three nodes on one buffer under the incoherent backend
with evictions off: a line leaves a node's private cache only through a flush, and a stale
line stays until invalidated, so a removed site shows deterministically, not by chance.
"""
from __future__ import annotations

import mmap

import numpy as np
import pytest
from numba import njit

import tract_kernels as K
from tract_async.region import index as ix

CAP, LANES, PROBE = 64, 4, 16
EOFF = 4096                                    # the entries follow a header page (lane lines)
MASK = CAP - 1
TGEO = np.full(6, -1, dtype=np.int64)          # an index without an allocator: no slot tags
ALL_LO = 0b11


@pytest.fixture
def buf() -> np.ndarray:
    mm = mmap.mmap(-1, EOFF + CAP * ix.ENTRY_BYTES)
    return np.frombuffer(mm, dtype=np.uint8)


def _mem(buf: np.ndarray, seed: int, skip: int = -1, lane: int = -1) -> K.Mem:
    """A node's view; with ``lane``, that node first takes its lane over (``clear_lane``: marks
    it active, as an engine's first hold of the lock does)."""
    m = K.make_mem(buf, "sim", seed=seed, evict_prob=0.0, skip_site=skip)
    if lane >= 0:
        ix.clear_lane(m, EOFF, MASK, LANES, lane)
    return m


def _key(home_group: int, tag: int) -> np.ndarray:
    """A key whose home group is ``home_group`` (its low bits pick the group: ``_home``)."""
    return np.array([[home_group * LANES + (tag << 8), tag, tag * 3, tag * 7]], dtype=np.uint64)


@njit(cache=True)
def _reserve_columns(m, eoff, tgeo, mask, probe, lanes, lane,  # noqa: ANN001, ANN202
                     key, ainfo, now, producer, flags, deadline, out):  # noqa: ANN001
    """``reserve_batch`` with the columns of ``ainfo``, as the engine's kernels pass them
    (``index.reserve_batch_counted``, ``fused.put_blocks``), and every scalar an argument (a
    constant would be typed as a literal): the signature the warm-up compiled, loaded from its
    cache. A call from Python passes contiguous arrays, another signature: the whole kernel
    compiled again, ~12 s in every test process."""
    ix.reserve_batch(m, eoff, tgeo, mask, probe, lanes, lane, key, ainfo[:, 0], ainfo[:, 1],
                     ainfo[:, 2], ainfo[:, 3], now, producer, flags, deadline, out)


def _reserve(m: K.Mem, lane: int, key: np.ndarray, poff: int = 4096) -> int:
    out = np.zeros((1, 3), dtype=np.int64)
    _reserve_columns(m, EOFF, TGEO, MASK, PROBE, LANES, lane, key,
                     np.array([[poff, 64, lane, 1]], dtype=np.uint64), 1, lane, 0, 0, out)
    return int(out[0, 0])


def _publish(m: K.Mem, slot: int) -> None:
    ix.publish_layers(m, EOFF, np.array([slot], dtype=np.int64), ALL_LO, 0, ALL_LO, 0)


def _put(m: K.Mem, lane: int, key: np.ndarray) -> int:
    slot = _reserve(m, lane, key)
    assert slot >= 0 and slot % LANES == lane
    _publish(m, slot)
    return slot


def _found(m: K.Mem, key: np.ndarray) -> tuple[int, int]:
    """(slot, state) a reader snapshots for ``key``."""
    out = np.zeros((1, 8), dtype=np.int64)
    ix.snapshot_batch(m, EOFF, MASK, PROBE, LANES, key, out)
    return int(out[0, 0]), int(out[0, 2])


def _evict(m: K.Mem, slot: int, own_lane: int) -> None:
    ix.evict_batch(m, EOFF, TGEO, MASK, LANES, own_lane, np.array([slot], dtype=np.int64),
                   ix.TOMBSTONE, np.zeros((1, 5), dtype=np.int64))


def test_two_nodes_reserve_one_home_group_without_losing_either(buf: np.ndarray) -> None:
    """Both nodes' entries of one home group live in their own lanes (own lines): written
    without any lock and flushed whole, neither write-back undoes the other."""
    a, b, reader = _mem(buf, 1, lane=1), _mem(buf, 2, lane=2), _mem(buf, 3)
    ka, kb = _key(5, 1), _key(5, 2)
    sa, sb = _reserve(a, 1, ka), _reserve(b, 2, kb)
    assert sa // LANES == sb // LANES == 5 and (sa % LANES, sb % LANES) == (1, 2)
    _publish(b, sb)
    _publish(a, sa)
    assert _found(reader, ka) == (sa, ix.READY) and _found(reader, kb) == (sb, ix.READY)


def test_a_key_live_in_another_lane_is_not_reserved_twice(buf: np.ndarray) -> None:
    a, b = _mem(buf, 1, lane=0), _mem(buf, 2, lane=3)
    k = _key(7, 9)
    s = _put(a, 0, k)
    assert _reserve(b, 3, k) == -(2 + s)


def test_without_the_reserve_flush_no_reader_finds_the_reservation(buf: np.ndarray) -> None:
    """A layer-streamed block is read while RESERVED: its consumer must see the reservation
    (key, payload) before the producer publishes the whole block."""
    for skip, visible in ((-1, True), (ix.S_IX_RESERVE_FLUSH, False)):
        buf[:] = 0
        a, reader = _mem(buf, 1, skip, lane=2), _mem(buf, 3)
        k = _key(3, 4)
        slot = _reserve(a, 2, k)
        assert slot >= 0
        assert (_found(reader, k) == (slot, ix.RESERVED)) is visible, skip


def test_without_the_readers_invalidate_it_keeps_missing(buf: np.ndarray) -> None:
    for skip, visible in ((-1, True), (ix.S_IX_READ, False)):
        buf[:] = 0
        a, reader = _mem(buf, 1, lane=1), _mem(buf, 3, skip)
        k = _key(9, 5)
        assert _found(reader, k)[0] == -1          # the reader now caches the home group
        slot = _put(a, 1, k)
        assert (_found(reader, k) == (slot, ix.READY)) is visible, skip


def test_a_lock_holders_eviction_lands_before_the_owner_reuses_the_entry(
        buf: np.ndarray) -> None:
    """Node 3 (holding the lock) evicts node 1's READY entry; node 1 then reserves that
    tombstone for another key, lock-free. With the eviction's flush the owner sees the
    tombstone and its reservation stands. Without it the owner never sees the tombstone, and
    when the evictor's dirty line is written back later (any later flush of that line) it
    overwrites what the owner wrote: the flush is what hands the entry back."""
    for skip in (-1, ix.S_IX_EVICT_FLUSH):
        buf[:] = 0
        owner, holder, reader = _mem(buf, 1, lane=1), _mem(buf, 3, skip), _mem(buf, 4)
        k1, k2 = _key(2, 1), _key(2, 2)
        s1 = _put(owner, 1, k1)
        _evict(holder, s1, own_lane=3)              # another lane: no sweep
        s2 = _reserve(owner, 1, k2)
        _publish(owner, s2)
        K.flush(holder, EOFF + s1 * ix.ENTRY_BYTES, K.NO_SITE)   # the evictor's line, late
        K.full_fence(holder)
        if skip < 0:
            assert s2 == s1, "the owner takes the tombstone"
            assert _found(reader, k2) == (s2, ix.READY) and _found(reader, k1)[0] == -1
        else:
            assert s2 != s1, "the owner never saw the tombstone"
            assert _found(reader, k1)[0] == -1      # the late write-back says TOMBSTONE
            assert _found(reader, k2) == (s2, ix.READY)


def test_an_owners_sweep_follows_its_lanes_chain(buf: np.ndarray) -> None:
    """Two keys of one home group in lane 0: the second lies one *group* further (slot + lanes).
    Evicting the first must leave it a tombstone -- the next entry of lane 0's chain is live --
    even though the next entry in memory (lane 1 of the same group) is EMPTY."""
    a, reader = _mem(buf, 1, lane=0), _mem(buf, 3)
    k1, k2 = _key(4, 1), _key(4, 2)
    s1, s2 = _put(a, 0, k1), _put(a, 0, k2)
    assert s2 == s1 + LANES
    _evict(a, s1, own_lane=0)
    assert _found(reader, k1)[0] == -1 and _found(reader, k2) == (s2, ix.READY)
    assert int(K.load_fresh(reader, EOFF + s1 * ix.ENTRY_BYTES + ix.E_STATE, ix.S_IX_READ)) == ix.TOMBSTONE
    _evict(a, s2, own_lane=0)                       # the chain's end: both become EMPTY again
    for s in (s1, s2):
        assert int(K.load_fresh(reader, EOFF + s * ix.ENTRY_BYTES + ix.E_STATE, ix.S_IX_READ)) == ix.EMPTY


def test_a_lock_holder_leaves_another_lanes_tombstones(buf: np.ndarray) -> None:
    """Only a lane's owner empties its tombstones: the lock holder's last write to an entry of
    another lane is the tombstone itself (the owner may take it at once)."""
    a, holder, reader = _mem(buf, 1, lane=2), _mem(buf, 3), _mem(buf, 4)
    k = _key(6, 1)
    s = _put(a, 2, k)
    _evict(holder, s, own_lane=3)
    assert int(K.load_fresh(reader, EOFF + s * ix.ENTRY_BYTES + ix.E_STATE, ix.S_IX_READ)) == ix.TOMBSTONE


def test_clear_lane_empties_only_its_lane(buf: np.ndarray) -> None:
    a, b, reader = _mem(buf, 1, lane=1), _mem(buf, 2, lane=2), _mem(buf, 3)
    ka, kb = _key(1, 1), _key(1, 2)
    sa, _ = _put(a, 1, ka), _put(b, 2, kb)
    assert ix.clear_lane(_mem(buf, 5), EOFF, MASK, LANES, 1) == 1
    assert _found(reader, ka)[0] == -1 and _found(reader, kb)[1] == ix.READY
    assert int(K.load_fresh(reader, EOFF + sa * ix.ENTRY_BYTES + ix.E_VERSION, ix.S_IX_READ)) == 2


def test_without_the_lanes_activation_flush_readers_skip_its_blocks(buf: np.ndarray) -> None:
    """Readers search only active lanes (``_active``): the owner's flush of its ``active`` word
    (``clear_lane``, before its first reservation) is what makes its entries findable."""
    for skip, visible in ((-1, True), (ix.S_IX_LANE_FLUSH, False)):
        buf[:] = 0
        a, reader = _mem(buf, 1, skip, lane=3), _mem(buf, 2)
        k = _key(8, 3)
        slot = _put(a, 3, k)
        assert (_found(reader, k) == (slot, ix.READY)) is visible, skip


def test_without_the_readers_lane_invalidate_it_never_sees_a_new_lane(buf: np.ndarray) -> None:
    for skip, visible in ((-1, True), (ix.S_IX_LANE_READ, False)):
        buf[:] = 0
        reader = _mem(buf, 2, skip)
        k = _key(8, 4)
        assert _found(reader, k)[0] == -1           # caches the lane lines: all inactive
        a = _mem(buf, 1, lane=1)
        slot = _put(a, 1, k)
        assert (_found(reader, k) == (slot, ix.READY)) is visible, skip


def test_lanes_for() -> None:
    assert [ix.lanes_for(n) for n in (1, 2, 3, 8, 9, 32, 33)] == [1, 2, 4, 8, 16, 32, 1]


# -- through an engine ------------------------------------------------------------------------

async def test_a_full_window_of_its_lane_evicts_the_nodes_oldest_there(region_path: str) -> None:
    """A node that alone fills a small index fills its lane's probe windows long before the
    region: a put then evicts this node's least recently used entry of the full window (under
    the lock) instead of failing, and every block still resident reads exact."""
    import tract_async as tract
    from tests.support.engine_util import block_matches, cfg, kv_for_keys

    async with tract.Engine.open(cfg(region_path, 0, create=True, index_capacity=256)) as eng:
        assert eng._store.index.lanes == 8 and eng._store.geo.max_probe == 32
        stored = []
        for r in range(24):                   # 24 x 8 blocks into a lane of 32 entries
            keys = eng.block_keys(range(r * 10_000, r * 10_000 + 16 * 8))
            await eng.put_kv(keys, kv_for_keys(keys))
            stored += keys
        st = eng.stats()
        assert st["evictions_for_space"] > 0 and st["lockfree_reservations"] > 0
        resident = [k for k in stored if eng.lookup([k])]
        assert 0 < len(resident) <= 32
        assert all(block_matches(resident, await eng.get_kv(resident)))
