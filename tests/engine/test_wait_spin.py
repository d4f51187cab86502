"""The spin of a same-host wait (``EngineConfig.wait_spin_us``, ``waits.auto_wait_spin_us``):
how long it is from the host, and that a wait ending within it never sleeps on the doorbell
while one that outlasts it does."""
from __future__ import annotations

import asyncio

import pytest

import tract_async as tract
from tests.support.engine_util import block_matches, cfg, kv_for_keys, np_out
from tract_async.errors import ConfigError
from tract_async.stores import waits


def test_the_spin_is_short_on_few_cores_and_long_on_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(waits.WAIT_SPIN_ENV, raising=False)
    assert waits.auto_wait_spin_us(1) == waits.auto_wait_spin_us(2) == waits.SHORT_SPIN_US == 300
    assert waits.auto_wait_spin_us(waits.MANY_CORES - 1) == waits.SHORT_SPIN_US
    assert waits.auto_wait_spin_us(waits.MANY_CORES) == waits.LONG_SPIN_US == 2000
    assert waits.auto_wait_spin_us(16) == waits.LONG_SPIN_US


def test_the_environment_overrides_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(waits.WAIT_SPIN_ENV, "50")
    assert waits.auto_wait_spin_us(16) == 50
    monkeypatch.setenv(waits.WAIT_SPIN_ENV, "0")
    assert waits.auto_wait_spin_us(2) == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "300"])
def test_a_bad_spin_is_refused(region_path: str, bad: object) -> None:
    with pytest.raises(ConfigError, match="wait_spin_us"):
        cfg(region_path, 0, create=True, wait_spin_us=bad)


async def test_the_config_sets_the_spin(region_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(waits.WAIT_SPIN_ENV, "123")
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a, \
            tract.Engine.open(cfg(region_path, 1, wait_spin_us=7)) as b:
        assert a._store.blocks.spin_ns == 123_000     # None: the environment, then the host
        assert b._store.blocks.spin_ns == 7_000


async def _late_put(prod: tract.Engine, cons: tract.Engine, tokens: list[int],
                    delay_s: float) -> None:
    """The consumer waits; the producer puts ``delay_s`` later (same loop: the spin's slices
    let the producer's task run)."""
    keys = cons.block_keys(tokens)
    waiting = asyncio.create_task(cons.get_kv(keys, out=np_out(keys), timeout=20.0))
    await asyncio.sleep(delay_s)
    await prod.put_kv(keys, kv_for_keys(keys, as_numpy=True))
    assert all(block_matches(keys, await waiting))


async def test_a_wait_within_the_spin_never_sleeps(region_path: str) -> None:
    """A spin of 2 s: each put 20 ms after its wait began is seen by the spin (``spin_wakes``),
    and no wait registers with the doorbell (none is rung)."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod, \
            tract.Engine.open(cfg(region_path, 1, wait_spin_us=2_000_000)) as cons:
        for r in range(3):
            await _late_put(prod, cons, list(range(16 * r, 16 * (r + 1))), 0.02)
        st = cons.stats()
        assert st["spin_wakes"] == 3
        assert st["doorbell_wakes"] == 0
        assert prod._store.blocks.doorbell.rings_sent == 0


@pytest.mark.parametrize("spin_us", [0, 1000])
async def test_a_wait_that_outlasts_the_spin_sleeps_on_the_doorbell(region_path: str,
                                                                    spin_us: int,
                                                                    monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    """No spin, or one of 1 ms against puts 100 ms late: every wait sleeps and the ring wakes it.
    The wait's safety timer (1-20 ms) is set past the test: on a loaded machine it fired between
    the put's publication and its ring and saw the block first (doorbell_wakes 2 of 3 in two CI
    runs at load average 4-15), a race of the test's, not a missing ring. A missing ring still
    fails: the wait would end by the timer, 5 s later, and not count as a doorbell wake."""
    from tract_async.stores import doorbell as db
    monkeypatch.setattr(db, "SAFETY_FIRST_S", 5.0)
    monkeypatch.setattr(db, "SAFETY_MAX_S", 5.0)
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod, \
            tract.Engine.open(cfg(region_path, 1, wait_spin_us=spin_us)) as cons:
        for r in range(3):
            await _late_put(prod, cons, list(range(16 * r, 16 * (r + 1))), 0.1)
        st = cons.stats()
        assert st["spin_wakes"] == 0
        assert st["doorbell_wakes"] == 3


def test_the_default_counts_the_cpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process confined to 2 CPUs of a large host spins as on a 2-core host."""
    import os
    monkeypatch.delenv(waits.WAIT_SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert waits.auto_wait_spin_us() == waits.SHORT_SPIN_US
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert waits.auto_wait_spin_us() == waits.LONG_SPIN_US


async def test_a_wait_looks_at_its_last_key_first(region_path: str) -> None:
    """``waits.ready_state`` with ``SENTINEL_MIN_KEYS`` keys or more: while the last key lacks
    the layer, a look reads that key alone (the other rows of the snapshot stay as they were);
    once it has it, the look reads every key and decides (another key without the layer: not
    ready); a key seen and then gone is reported as vanished, with every row read."""
    import numpy as np
    from tract_async.keys import keys_to_words
    from tests.support.engine_util import TINY
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as prod, \
            tract.Engine.open(cfg(region_path, 1)) as cons:
        keys = prod.block_keys(range(20 * TINY.block_tokens))
        n = len(keys)
        assert n >= waits.SENTINEL_MIN_KEYS
        kv = kv_for_keys(keys, as_numpy=True)
        bt = TINY.block_tokens
        st = cons._store
        g = st.geo
        words = keys_to_words(keys)
        seen = np.zeros(n, dtype=np.uint8)

        def look(layer: int) -> tuple[int, np.ndarray]:
            snap = np.full((n, 8), 777, dtype=np.int64)
            r = waits.ready_state(st.mem, g.entries_offset, st.index.mask, g.max_probe, g.lanes,
                                  words, 0, np.uint64(1 << layer), False, snap, seen)
            return int(r), snap

        await prod.put_kv(keys, np.ascontiguousarray(kv[0]), layer=0)
        r, snap = look(1)
        assert r == 0 and (snap[:-1] == 777).all() and snap[-1, 0] >= 0   # the last key alone
        await prod.put_kv(keys[:-1], np.ascontiguousarray(kv[1][:, :(n - 1) * bt]), layer=1)
        r, snap = look(1)
        assert r == 0 and (snap[:-1] == 777).all()
        await prod.put_kv(keys[-1:], np.ascontiguousarray(kv[1][:, (n - 1) * bt:]), layer=1)
        r, snap = look(1)
        assert r == 1 and (snap[:, 0] >= 0).all()                        # every key read
        # the last key has layer 2, the others not: the full look says not yet
        await prod.put_kv(keys[-1:], np.ascontiguousarray(kv[2][:, (n - 1) * bt:]), layer=2)
        r, snap = look(2)
        assert r == 0 and (snap[:, 0] >= 0).all() and (snap[:-1] != 777).all()
        # the last key abandoned by its producer: vanished (the others have layer 0), with
        # every row read for the report
        await prod._store.blocks.abandon(keys[-1:])
        r, snap = look(0)
        assert r == -1 and snap[-1, 0] < 0 and (snap[:-1, 0] >= 0).all()
        await prod._store.blocks.abandon(keys)
