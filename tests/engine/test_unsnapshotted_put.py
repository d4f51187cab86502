"""Puts that reserve without an index snapshot (``BlockLifecycle.snapshot_for_put``).

While a node's last put found none of its keys present, a large put takes every key as absent
and lets the reservation kernel skip the present ones. These tests check what that must not
change: a present block keeps its bytes (a put that carries other bytes for its key does not
overwrite them), the counts of stored and skipped blocks, no slot leaked (allocator self-check,
fsck of the region after the test), and the next put snapshots again after one found a present
key. Both backends (the sim's incoherent caches would show a missing flush of the skipped
slots' give-back).
"""
from __future__ import annotations

import hashlib

import tract_async as tract
from tract_async.stores import reservation as B
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


async def test_a_put_without_snapshot_skips_present_blocks(region_path: str, backend: str) -> None:
    n = B.OPTIMISTIC_MIN_KEYS
    a, b, c = _keys("a", n), _keys("b", n), _keys("c", n)
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as eng:
        st = eng._store.stats
        assert await eng.put_kv(a, kv_for_keys(a)) == n           # fresh: no snapshot
        assert st.unsnapshotted_puts == 1 and st.blocks_skipped == 0
        # a and b together, with other bytes for a's keys: a stays as it was, b is stored
        mixed = a + b
        other = kv_for_keys(_keys("not-a", n) + b)
        assert await eng.put_kv(mixed, other) == n
        assert st.unsnapshotted_puts == 2 and st.blocks_skipped == n
        got = await eng.get_kv(mixed)
        assert all(block_matches(mixed, got)), "a present block was overwritten"
        # that put found present keys: the next one snapshots (and skips them before allocating)
        assert await eng.put_kv(a + c, kv_for_keys(a + c)) == n
        assert st.unsnapshotted_puts == 2 and st.blocks_skipped == 2 * n
        got = await eng.get_kv(a + c)
        assert all(block_matches(a + c, got))
        # it found present keys too (by its snapshot): the next put snapshots as well; that
        # one finds none, and the one after it skips the snapshot again
        d, e = _keys("d", n), _keys("e", n)
        assert await eng.put_kv(d, kv_for_keys(d)) == n
        assert st.unsnapshotted_puts == 2
        assert await eng.put_kv(e, kv_for_keys(e)) == n
        assert st.unsnapshotted_puts == 3
        assert eng._store.alloc.self_check() == []
        assert eng._store.blocks.in_flight == 0
        assert eng.lookup(a + b + c + d + e) == 5 * n


async def test_small_puts_always_snapshot(region_path: str) -> None:
    n = B.OPTIMISTIC_MIN_KEYS - 1
    a = _keys("a", n)
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        assert await eng.put_kv(a, kv_for_keys(a)) == n
        assert eng._store.stats.unsnapshotted_puts == 0
