"""The copy gang (``stores/copygang.py``, ``region/gangcopy.py``): GIL-free copy workers.

Exact bytes for every job kind and through the engine; a busy gang sends the next copy to the
thread pool; a cancelled copy returns only when every worker is done; a row outside the region
is refused before anything is posted; idle workers take no CPU; the workers finish a copy while
the loop's thread holds the GIL (negative control: the pool's threads cannot even start).
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import tract_async as tract
from tests.support.engine_util import TINY, cfg, kv_for_keys
from tract_async.region import Region
from tract_async.region import gangcopy as G
from tract_async.region import index as ix
from tract_async.stores import cpucopy, routing

MiB = 1 << 20
ROW = 16 << 10


def _plan(nbytes: int, base: int, stride: int = 64 << 10) -> np.ndarray:
    n = nbytes // ROW
    plan = np.empty((n, 3), dtype=np.int64)
    plan[:, 0] = base + np.arange(n, dtype=np.int64) * stride
    plan[:, 1] = np.arange(n, dtype=np.int64) * ROW
    plan[:, 2] = ROW
    return plan


@pytest.fixture
def region(region_path: str) -> Iterator[Region]:
    r = Region.create(region_path, 128 * MiB, max_nodes=2)
    try:
        yield r
    finally:
        r.close()


def _gang_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tract-gang-")]


async def test_every_kind_copies_exactly_on_the_gang(region: Region) -> None:
    copier = cpucopy.CpuCopier(region, copy_threads=4)
    try:
        for nbytes in (2 * MiB, 4 * MiB, 9 * MiB + ROW):    # 2, 4 and 4 (capped) groups
            plan = _plan(nbytes, region.data_offset)
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            before = copier.gang_copies
            await copier.copy_in(plan, src.data_ptr(), nbytes)
            for nt in (False, True):       # copy_out, and copy_out_nt (forced by the size)
                dst = torch.zeros(nbytes, dtype=torch.uint8)
                if nt:
                    big = routing.NT_READ_BYTES
                    plan_nt = _plan(big, region.data_offset)
                    dst = torch.zeros(big, dtype=torch.uint8)
                    src_nt = torch.randint(0, 256, (big,), dtype=torch.uint8)
                    await copier.copy_in(plan_nt, src_nt.data_ptr(), big)
                    await copier.copy_out(plan_nt, dst.data_ptr(), big)
                    assert torch.equal(dst, src_nt)
                else:
                    await copier.copy_out(plan, dst.data_ptr(), nbytes)
                    assert torch.equal(dst, src)
            assert copier.gang_copies == before + 4, "every cut copy ran on the gang"
        assert len(_gang_threads()) == 4
    finally:
        copier.shutdown()
    assert not _gang_threads()
    copier.shutdown()                       # idempotent


async def test_a_busy_gang_sends_the_next_copy_to_the_pool(region: Region) -> None:
    copier = cpucopy.CpuCopier(region, copy_threads=2)
    try:
        a = torch.randint(0, 256, (32 * MiB,), dtype=torch.uint8)
        b = torch.randint(0, 256, (32 * MiB,), dtype=torch.uint8)
        pa = _plan(32 * MiB, region.data_offset, ROW)
        pb = _plan(32 * MiB, region.data_offset + 48 * MiB, ROW)
        # both tasks are ready before either runs: the second starts while the first's workers
        # copy (its completion is an I/O callback, which runs only after the ready tasks)
        ta = asyncio.ensure_future(copier.copy_in(pa, a.data_ptr(), 32 * MiB))
        tb = asyncio.ensure_future(copier.copy_in(pb, b.data_ptr(), 32 * MiB))
        await asyncio.gather(ta, tb)
        assert copier.gang_copies == 1
        out = torch.empty(32 * MiB, dtype=torch.uint8)
        await copier.copy_out(pa, out.data_ptr(), 32 * MiB)
        assert torch.equal(out, a)
        await copier.copy_out(pb, out.data_ptr(), 32 * MiB)
        assert torch.equal(out, b)
    finally:
        copier.shutdown()


async def test_a_cancelled_copy_returns_after_every_worker(region: Region) -> None:
    copier = cpucopy.CpuCopier(region, copy_threads=4)
    try:
        nbytes = 64 * MiB
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        plan = _plan(nbytes, region.data_offset, ROW)
        task = asyncio.ensure_future(copier.copy_in(plan, src.data_ptr(), nbytes))
        await asyncio.sleep(0)             # posted: the workers are copying
        gang = copier._gang
        assert gang is not None and not gang.idle
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = gang.board[:, G.J_DONE].copy()
        assert gang.idle and done.sum() == 4, done     # every worker finished its group
        out = torch.empty(nbytes, dtype=torch.uint8)
        await copier.copy_out(plan, out.data_ptr(), nbytes)
        assert torch.equal(out, src)       # and the bytes are whole
    finally:
        copier.shutdown()


async def test_a_row_outside_the_region_is_refused_before_posting(region: Region) -> None:
    copier = cpucopy.CpuCopier(region, copy_threads=2)
    try:
        plan = _plan(4 * MiB, region.size_bytes - 2 * MiB, ROW)   # its second half is outside
        src = torch.zeros(4 * MiB, dtype=torch.uint8)
        with pytest.raises(IndexError):
            await copier.copy_in(plan, src.data_ptr(), 4 * MiB)
        gang = copier._gang
        assert gang is not None and gang.idle and not _gang_threads()  # nothing was posted
    finally:
        copier.shutdown()


async def test_idle_workers_take_no_cpu(region: Region) -> None:
    copier = cpucopy.CpuCopier(region, copy_threads=4)
    try:
        src = torch.zeros(8 * MiB, dtype=torch.uint8)
        await copier.copy_in(_plan(8 * MiB, region.data_offset), src.data_ptr(), 8 * MiB)
        assert len(_gang_threads()) == 4
        c0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        cpu = time.process_time() - c0
        assert cpu < 0.05 * (time.monotonic() - t0), f"{cpu:.3f} s of CPU while idle"
    finally:
        copier.shutdown()


@pytest.mark.parametrize("gang", [True, False])
async def test_workers_copy_while_the_loop_holds_the_gil(region: Region, gang: bool) -> None:
    """Right after the copy is posted, in the same loop iteration, the loop's thread spins in
    Python for 0.4 s holding the GIL (no forced switch for 10 s). The gang's workers finish the
    copy meanwhile; the pool's threads (negative control) cannot even call their kernel."""
    # the workers' own mechanics: the loop's thread copies no share of its own here
    copier = cpucopy.CpuCopier(region, copy_threads=2, gang=gang, loop_share=False)
    started: list[int] = []
    real = ix.copy_in

    def watched(m, plan, base):             # noqa: ANN001, ANN202 - a pool thread's entry
        started.append(threading.get_ident())
        return real(m, plan, base)
    nbytes = 4 * MiB
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    plan = _plan(nbytes, region.data_offset)
    old = sys.getswitchinterval()
    seen: dict[str, object] = {}

    def spin() -> None:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            pass
        seen["done"] = (int(copier._gang.board[:, G.J_DONE].sum() - done0)
                        if copier._gang is not None else None)
        seen["started"] = list(started)
        sys.setswitchinterval(old)
    try:
        if not gang:
            ix.copy_in = watched            # the pool path (a wrapped function never gangs)
        # warm up: the workers (or pool threads) exist and wait outside the GIL
        await copier.copy_in(plan, src.data_ptr(), nbytes)
        done0 = int(copier._gang.board[:, G.J_DONE].sum()) if gang else 0
        started.clear()
        sys.setswitchinterval(10.0)
        if gang:
            task = asyncio.ensure_future(copier.copy_in(plan, src.data_ptr(), nbytes))
            asyncio.get_running_loop().call_soon(spin)    # right after the task's first step
        else:
            # the pool's spin starts inside the second submission, in the task's first step:
            # run by call_soon it came one loop iteration later, after a select() that lets the
            # GIL go, and beside two busy loops a woken pool thread was waiting for it there
            # and ran its item's Python before the spin began ("a pool thread ran Python
            # while the loop held the GIL", its call stamped before the spin's start)
            pool = copier._copy_pool()
            submit = pool.submit
            posted = [0]

            def submit_then_spin(*a, **kw):  # noqa: ANN002, ANN003, ANN202
                fut = submit(*a, **kw)
                posted[0] += 1
                if posted[0] == 2:
                    spin()
                return fut
            pool.submit = submit_then_spin
            task = asyncio.ensure_future(copier.copy_in(plan, src.data_ptr(), nbytes))
        await task
        if not gang:
            assert posted[0] == 2, f"the copy was posted as {posted[0]} items, not 2"
        if gang:
            assert seen["done"] == 2, f"the workers finished {seen['done']} of 2 groups"
        else:
            assert seen["started"] == [], "a pool thread ran Python while the loop held the GIL"
            assert len(started) == 2             # they ran once the loop let go
        out = torch.empty(nbytes, dtype=torch.uint8)
        await copier.copy_out(plan, out.data_ptr(), nbytes)
        assert torch.equal(out, src)
    finally:
        sys.setswitchinterval(old)
        ix.copy_in = real
        copier.shutdown()


async def test_engine_layer_streaming_runs_on_the_gang(region_path: str) -> None:
    """Through the engine: 4 MiB layers of a 16 MiB transfer go to the gang (puts as copies,
    gets as parallel reads: ``stores/parallel.py``), bytes exact; the sim backend never uses
    it."""
    layout = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=4, head_dim=64,
                            dtype=torch.bfloat16)
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=4, layout=layout,
                                     region_bytes=96 << 20)) as eng:
        n = (16 << 20) // layout.block_bytes
        keys = eng.block_keys(range(layout.block_tokens * n))
        for layer in range(layout.num_layers):
            await eng.put_kv(keys, kv_for_keys(keys, layout, layer), layer=layer)
        for layer in range(layout.num_layers):
            got = await eng.get_kv(keys, layer=layer)
            assert torch.equal(got, kv_for_keys(keys, layout, layer)), layer
        # the puts' copies, and the gets as parallel reads (each group checked on its thread)
        assert eng._store.copier.gang_copies == layout.num_layers
        assert eng._store.stats.parallel_reads == layout.num_layers


async def test_the_sim_backend_never_gangs(region_path: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend="sim", copy_threads=4,
                                     region_bytes=64 << 20)) as eng:
        n = (9 << 20) // TINY.block_bytes
        keys = eng.block_keys(range(TINY.block_tokens * n))
        kv = kv_for_keys(keys)
        await eng.put_kv(keys, kv)
        assert torch.equal(await eng.get_kv(keys), kv)
        assert eng._store.copier.gang_copies == 0 and eng._store.copier._gang is None


async def test_the_loop_copies_a_share_and_returns_without_sleeping(region: Region) -> None:
    """A 4 MiB copy on 4 threads: the loop's thread copies one group itself and the workers
    three (their done counts grow by 3); bytes exact both ways."""
    copier = cpucopy.CpuCopier(region, copy_threads=4)
    try:
        nbytes = 4 * MiB
        plan = _plan(nbytes, region.data_offset)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        await copier.copy_in(plan, src.data_ptr(), nbytes)
        gang = copier._gang
        assert gang is not None and copier.loop_shares == 1
        done0 = int(gang.board[:, G.J_DONE].sum())
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        await copier.copy_out(plan, dst.data_ptr(), nbytes)
        assert torch.equal(dst, src)
        assert copier.loop_shares == 2 and int(gang.board[:, G.J_DONE].sum()) == done0 + 3
        assert gang.idle
    finally:
        copier.shutdown()


@pytest.mark.parametrize("spin_us", [0, 500])
async def test_copies_after_the_workers_poll_ran_out(region: Region, spin_us: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies back to back (taken by the workers' poll, their wakes left counted in the
    eventfd), then after a pause longer than the poll (the next read() returns that stale
    count at once and must sleep again, not run a job twice or miss one), and with no poll at
    all: every copy exact, every worker's done count equal to its jobs."""
    from tract_async.stores import copygang
    monkeypatch.setattr(copygang, "WORKER_SPIN_NS", spin_us * 1000)
    copier = cpucopy.CpuCopier(region, copy_threads=3, loop_share=False)
    try:
        nbytes = 3 * MiB
        plan = _plan(nbytes, region.data_offset)
        for rnd in range(6):
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            await copier.copy_in(plan, src.data_ptr(), nbytes)
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            await copier.copy_out(plan, dst.data_ptr(), nbytes)
            assert torch.equal(dst, src), rnd
            if rnd % 2:
                await asyncio.sleep(0.01)          # past the poll: the workers sleep again
        gang = copier._gang
        assert gang is not None
        assert gang.board[:, G.J_DONE].tolist() == [12, 12, 12]
        assert gang.board[:, G.J_SEQ].tolist() == [12, 12, 12]
    finally:
        copier.shutdown()
    assert not _gang_threads()
