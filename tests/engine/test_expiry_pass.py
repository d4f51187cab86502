"""Transfer-mode expiry: the maintenance pass (``index.expired_transfer_slots``) finds exactly the
READY transfer-only entries past their deadline, on the incoherent backend too, and runs at most
``EXPIRY_SCANS_PER_DEADLINE`` times per deadline (a full pass holds the global lock)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import tract_async as tract
from tract_async.region import index as ix
from tests.support.engine_util import cfg, kv_for_keys


def _reference(eng: tract.Engine, now_ns: int) -> list[int]:
    """The former pass: a fresh scan of every entry, filtered with numpy."""
    t = eng._store.index.scan()
    hit = (t[:, 0] == ix.READY) & ((t[:, 4] & ix.FLAG_TRANSFER) != 0) & (t[:, 5] <= now_ns)
    return np.flatnonzero(hit).tolist()


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_the_pass_finds_exactly_the_expired_transfer_entries(region_path: str,
                                                                    backend: str) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True, backend=backend,
                                    mode="transfer", transfer_deadline_s=600.0))
    b = await tract.Engine.open(cfg(region_path, 1, backend=backend, mode="transfer",
                                    transfer_deadline_s=600.0))
    c = await tract.Engine.open(cfg(region_path, 2, backend=backend, mode="cache"))
    try:
        ib = b._store.index
        far = time.time_ns() + 10**13
        # b reads every entry line first: on the incoherent backend it now holds them (EMPTY),
        # so a pass that did not invalidate would miss what a and c write next
        assert ib.expired_transfer(far).size == 0
        k1, k2 = a.block_keys(range(48)), a.block_keys(range(500, 532))
        await a.put_kv(k1, kv_for_keys(k1))
        await a.put_kv(k2, kv_for_keys(k2))
        k3 = c.block_keys(range(900, 948))           # cache mode: never expires
        await c.put_kv(k3, kv_for_keys(k3))
        assert ib.expired_transfer(time.time_ns()).size == 0     # none due yet
        got = sorted(ib.expired_transfer(far).tolist())
        assert len(got) == len(k1) + len(k2) == 5
        assert got == _reference(b, far)
        assert not set(got) & set(
            np.flatnonzero(ib.scan()[:, 4] & ix.FLAG_TRANSFER == 0).tolist())
    finally:
        for e in (c, b, a):
            await e.close()


async def test_maintenance_looks_for_expired_blocks_a_few_times_per_deadline(
        region_path: str) -> None:
    a = await tract.Engine.open(cfg(region_path, 0, create=True, mode="transfer",
                                    transfer_deadline_s=8.0))
    try:
        blocks = a._store.blocks
        calls: list[int] = []
        real = blocks.index.expired_transfer

        def counting(now_ns: int) -> np.ndarray:
            calls.append(now_ns)
            return real(now_ns)
        blocks.index.expired_transfer = counting     # type: ignore[method-assign]
        t0 = time.monotonic()
        for _ in range(20):
            await blocks.maintain(timeout=5.0)
        elapsed = time.monotonic() - t0
        # one pass per deadline / EXPIRY_SCANS_PER_DEADLINE (1 s here); the engine's own
        # maintenance task may have taken one since the engine opened
        assert len(calls) <= 1 + int(elapsed / (8.0 / blocks.EXPIRY_SCANS_PER_DEADLINE)) + 1
        blocks._next_expiry = 0.0
        await blocks.maintain(timeout=5.0)
        assert len(calls) >= 1
    finally:
        await a.close()
