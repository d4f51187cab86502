"""Part 1 of ``bench/putget.py``: one Engine's ``put_kv`` / ``get_kv`` against torch ``copy_``.

Per size: the engine first (timed gets of one resident set, an instrumented pass of gets, then
puts of fresh keys, the last of them instrumented), the baselines after it, because torch's
OpenMP workers spin for a while after a parallel ``copy_`` and would steal the second core from
the engine's threads. The instrumented passes read the region store's own phase timer
(``Engine.time_phases``, stores/phases.py): nothing of the engine is wrapped or patched.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import numpy as np
import torch

import _common as C
import tract_async as tract
import tract_kernels as K
from tract_async.keys import keys_to_words
from tract_async.stores import plan as kvplan

from _putget.fixtures import (BLOCK, LAYOUT, MiB, REGION_OVERHEAD, S_BENCH, TORCH_THREADS, Mapping,
                              atimeit, engine_cfg, make_kv, rand_keys, shm_path, timeit)


class Phases:
    """Phase times of the calls made between construction and ``restore()``, from the region
    store's public timer (no wrapping of its internals). ``lock_wait`` comes from the store's
    own stats."""

    def __init__(self, eng: tract.Engine) -> None:
        self.eng = eng
        self.timer = eng.time_phases(True)
        self.acc: dict[str, float] = {}

    def restore(self) -> None:
        self.acc.update(self.timer.take())
        self.eng.time_phases(False)


def med_phases(calls: list[dict[str, float]]) -> dict[str, float]:
    """Median of each phase over the calls (a phase absent from a call counts as 0)."""
    keys = {k for c in calls for k in c}
    return {k: C.median([c.get(k, 0.0) for c in calls]) for k in keys}


def reps_for(nbytes: int, quick: bool) -> int:
    """Enough samples for a median, bounded bytes per size (512 MiB, 64 MiB with --quick)."""
    budget = (64 if quick else 512) * MiB
    return int(max(5, min(60 if quick else 300, budget // nbytes)))


class FreshEngine:
    """Node 0 on a region that is created again at every ``reopen()``.

    Re-create rather than re-attach: Region.attach maps without MAP_POPULATE (only MADV_WILLNEED),
    so every first touch of a page in an attached region page-faults; part 1 measures the engine
    on a prefaulted (created) region. (Re-attaching here measured the put copy at 2.5-3 GB/s
    instead of 8.5-12: see Findings in bench/putget.py.) Closing also evicts our blocks, which is
    how the put loop gets room without evicting during a timed put.
    """

    def __init__(self, path: str, region_bytes: int) -> None:
        self.path = path
        self.region_bytes = region_bytes
        self.eng: tract.Engine | None = None

    async def open(self) -> tract.Engine:
        self.eng = await tract.Engine.open(engine_cfg(self.path, 0, self.region_bytes, True))
        return self.eng

    async def reopen(self) -> tract.Engine:
        assert self.eng is not None, "FreshEngine.reopen before open"
        # an intermittent hang in close/open was seen twice (no heartbeat thread left, loop
        # idle): bound it so that it reports instead of waiting for the watchdog
        await asyncio.wait_for(self.eng.close(), 60)
        os.unlink(self.path)
        self.eng = await asyncio.wait_for(
            tract.Engine.open(engine_cfg(self.path, 0, self.region_bytes, True)), 60)
        return self.eng

    async def close(self) -> None:
        """Close the engine (reporting, not raising, a failure) and remove the region file."""
        if self.eng is not None:
            try:
                await self.eng.close()
            except Exception as e:  # noqa: BLE001 - the run's results are worth more
                print(f"engine close: {e}", file=sys.stderr)
        if os.path.exists(self.path):
            os.unlink(self.path)


async def time_gets(eng: tract.Engine, keys: list[bytes], out: torch.Tensor, reps: int,
                    ireps: int) -> tuple[list[float], list[dict[str, float]]]:
    """``reps`` timed gets of resident ``keys``, then ``ireps`` instrumented ones (their phases)."""
    samples = await atimeit(lambda: eng.get_kv(keys, out=out), reps)
    calls = []
    for _ in range(ireps):
        ph = Phases(eng)
        t0 = time.perf_counter_ns()
        await eng.get_kv(keys, out=out)
        ph.acc["total"] = (time.perf_counter_ns() - t0) / 1e9
        ph.restore()
        calls.append(ph.acc)
    return samples, calls


async def time_puts(fresh: FreshEngine, kv: torch.Tensor, usable: int, reps: int,
                    ireps: int) -> tuple[list[float], list[dict[str, float]], int]:
    """``reps`` timed puts of fresh keys, then ``ireps`` instrumented ones; the region is
    re-created before it would have to evict. Returns samples, phases and evictions seen."""
    eng = await fresh.reopen()
    nbytes = kv.numel() * kv.element_size()
    n = nbytes // BLOCK
    used = evictions = 0
    samples, calls = [], []
    for rep in range(reps + ireps):
        if used + nbytes > usable:
            evictions += eng.stats()["evictions"]
            eng = await fresh.reopen()
            used = 0
        k = rand_keys(n)
        instrumented = rep >= reps
        if instrumented:
            ph = Phases(eng)
            lw0 = eng.stats()["lock_wait_s"]
        t0 = time.perf_counter_ns()
        await eng.put_kv(k, kv)
        dt = (time.perf_counter_ns() - t0) / 1e9
        used += nbytes
        if instrumented:
            ph.restore()
            ph.acc["lock_wait"] = eng.stats()["lock_wait_s"] - lw0
            ph.acc["total"] = dt
            calls.append(ph.acc)
        else:
            samples.append(dt)
    return samples, calls, evictions + eng.stats()["evictions"]


def time_baselines(base: Mapping, src_b: torch.Tensor, out_b: torch.Tensor, priv: torch.Tensor,
                   reps: int) -> dict[str, list[float]]:
    """torch ``copy_`` into / out of a plain mapping (default threads and one thread), the same
    made to reach memory or read from it, a private memcpy into ``priv`` and the bare kernels."""
    s = src_b.numel()
    shm = base.t[:s]
    tc = {"memcpy": timeit(lambda: np.copyto(priv.numpy(), src_b.numpy()), reps),
          "torch_put": timeit(lambda: shm.copy_(src_b), reps),
          "torch_get": timeit(lambda: out_b.copy_(shm), reps),
          "torch_put+flush": timeit(lambda: (shm.copy_(src_b),
                                             K.flush_range(base.mem, 0, s, S_BENCH)), reps),
          "inval+torch_get": timeit(lambda: (K.invalidate_range(base.mem, 0, s, S_BENCH),
                                             out_b.copy_(shm)), reps),
          "nt_write_kernel": timeit(lambda: K.write_bytes(base.mem, 0, src_b.data_ptr(), s,
                                                          S_BENCH), reps),
          "inval_read_kernel": timeit(lambda: K.read_bytes(base.mem, 0, out_b.data_ptr(), s,
                                                           S_BENCH), reps)}
    torch.set_num_threads(1)
    try:
        tc["torch_put_1thr"] = timeit(lambda: shm.copy_(src_b), reps)
        tc["torch_get_1thr"] = timeit(lambda: out_b.copy_(shm), reps)
    finally:
        torch.set_num_threads(TORCH_THREADS)
    return tc


def size_row(s: int, reps: int, tc: dict[str, list[float]], evictions: int) -> dict[str, Any]:
    """One row of the put/get table: GB/s of the medians, ratios and every sample."""
    med = {k: C.median(v) for k, v in tc.items()}
    gb = {k: s / v / 1e9 for k, v in med.items()}
    # the baseline is the better of torch's default threads and one thread (on this noisy 2-vCPU
    # VM the 2-thread copy_ is sometimes far slower at small sizes)
    torch_put = max(gb["torch_put"], gb["torch_put_1thr"])
    torch_get = max(gb["torch_get"], gb["torch_get_1thr"])
    return {
        "size": C.human_bytes(s), "bytes": s, "reps": reps,
        "put_GBps": gb["put"], "torch_put_GBps": torch_put, "put/torch": gb["put"] / torch_put,
        "get_GBps": gb["get"], "torch_get_GBps": torch_get, "get/torch": gb["get"] / torch_get,
        "torch_put_default_GBps": gb["torch_put"], "torch_get_default_GBps": gb["torch_get"],
        "memcpy_GBps": gb["memcpy"],
        "put_floor_us": s / gb["memcpy"] / 1e3, "put_us": med["put"] * 1e6,
        "get_us": med["get"] * 1e6,
        "torch_put+flush_GBps": gb["torch_put+flush"], "inval+torch_get_GBps": gb["inval+torch_get"],
        "nt_write_kernel_GBps": gb["nt_write_kernel"],
        "inval_read_kernel_GBps": gb["inval_read_kernel"],
        "torch_put_1thr_GBps": gb["torch_put_1thr"], "torch_get_1thr_GBps": gb["torch_get_1thr"],
        "evictions_during_puts": evictions,
        "samples_s": dict(tc),
    }


def phase_rows(s: int, put_phase: dict[str, float], get_phase: dict[str, float],
               lock: dict[str, Any]) -> list[dict[str, Any]]:
    """The put and the get row of "where the time goes", in microseconds; ``other_us`` is what
    the timed phases do not cover (Python, checks, the event loop)."""
    def us(d: dict[str, float], k: str) -> float:
        return d.get(k, 0.0) * 1e6
    size = C.human_bytes(s)
    pp = {"size": size, "op": "put", "total_us": us(put_phase, "total"),
          "lock_wait_us": us(put_phase, "lock_wait"),
          "reserve_held_us": us(put_phase, "reserve_incl_lock") - us(put_phase, "lock_wait"),
          "snapshot_us": us(put_phase, "snapshot"),
          "publish_us": us(put_phase, "publish"),
          "copy_kernel_us": us(put_phase, "copy_kernel"),
          "copy_hop_us": us(put_phase, "copy_call") - us(put_phase, "copy_kernel"),
          "fused_us": us(put_phase, "fused")}
    pp["staged_us"] = us(put_phase, "staged")
    if pp["staged_us"]:
        # a staged put (stores/region.py): its stages' snapshots, reservations and copies
        # overlap, so they do not add up; "staged" is their wall time together
        pp["other_us"] = pp["total_us"] - pp["staged_us"]
    else:
        pp["other_us"] = pp["total_us"] - sum(pp[k] for k in (
            "lock_wait_us", "reserve_held_us", "snapshot_us", "copy_kernel_us", "copy_hop_us",
            "fused_us"))
    # a fused call has no copy phase of its own: no copy-only figure then
    pp["copy_only_GBps"] = (s / put_phase["copy_kernel"] / 1e9
                            if put_phase.get("copy_kernel", 0) > 0 else None)
    pp["lock_wait_p50_us"] = (lock.get("wait_p50_s") or 0) * 1e6
    gp = {"size": size, "op": "get", "total_us": us(get_phase, "total"),
          "snapshot_us": us(get_phase, "prepare_read"),
          "validate_us": us(get_phase, "validate"),
          "copy_kernel_us": us(get_phase, "copy_kernel"),
          "copy_hop_us": us(get_phase, "copy_call") - us(get_phase, "copy_kernel"),
          "fused_us": us(get_phase, "fused"),
          # a parallel read (stores/parallel.py): every group's snapshot, copy and
          # revalidation on its own thread; their wall time together
          "parallel_us": us(get_phase, "parallel")}
    gp["other_us"] = (gp["total_us"] - gp["snapshot_us"] - gp["copy_kernel_us"]
                      - gp["copy_hop_us"] - gp["fused_us"] - gp["parallel_us"])
    gp["copy_only_GBps"] = (s / get_phase["copy_kernel"] / 1e9
                            if get_phase.get("copy_kernel", 0) > 0 else None)
    return [pp, gp]


def fixed_pieces_us(kv: torch.Tensor, n: int) -> dict[str, float]:
    """Pieces of a put's per-call fixed cost, timed alone on the inputs of the put above."""
    poffs = np.arange(n, dtype=np.int64) * BLOCK
    ks = rand_keys(n)
    pieces = {"check_keys": timeit(lambda: kvplan.check_keys(ks), 20),
              "keys_to_words": timeit(lambda: keys_to_words(ks), 20),
              "plan": timeit(lambda: kvplan.plan(LAYOUT, poffs, np.arange(n), n, None), 20),
              "check_tensor": timeit(lambda: kvplan.check_tensor(kv, LAYOUT, n, None,
                                                                 what="kv"), 20)}
    return {k: C.median(v) * 1e6 for k, v in pieces.items()}


async def part_putget(sizes: list[int], quick: bool) -> dict[str, Any]:
    """Rows of GB/s per size, the phase split, the fixed-cost pieces and the last lock stats."""
    max_size = max(sizes)
    usable = 2 * max_size
    fresh = FreshEngine(shm_path("putget"), usable + REGION_OVERHEAD)
    base = Mapping(shm_path("torch"), max_size + MiB)
    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    try:
        eng = await fresh.open()
        warm = make_kv(1)
        for _ in range(3):  # JIT / cache loads out of the way
            k = rand_keys(1)
            await eng.put_kv(k, warm)
            await eng.get_kv(k, out=torch.empty_like(warm))
        eng = await fresh.reopen()

        for s in sizes:
            n = s // BLOCK
            reps = reps_for(s, quick)
            ireps = max(5, reps // 2)
            kv = make_kv(n)
            out = torch.empty_like(kv)
            src_b = kv.view(-1).view(torch.uint8)
            out_b = out.view(-1).view(torch.uint8)
            priv = torch.empty(s, dtype=torch.uint8)  # touched now: the memcpy baseline's target
            priv.fill_(3)

            # the engine first: get re-reads one resident set
            await asyncio.sleep(0.3)  # let the previous size's torch workers stop spinning
            keys = rand_keys(n)
            await eng.put_kv(keys, kv)
            await eng.get_kv(keys, out=out)
            assert torch.equal(out_b, src_b), "get returned different bytes"
            tc: dict[str, list[float]] = {}
            tc["get"], get_calls = await time_gets(eng, keys, out, reps, ireps)
            tc["put"], put_calls, evictions = await time_puts(fresh, kv, usable, reps, ireps)
            eng = fresh.eng
            lock = eng.stats().get("lock", {})
            tc.update(time_baselines(base, src_b, out_b, priv, reps))

            rows.append(size_row(s, reps, tc, evictions))
            phases += phase_rows(s, med_phases(put_calls), med_phases(get_calls), lock)
            if n <= 1 or s == max_size:
                extra[f"fixed_pieces_us_{C.human_bytes(s)}"] = fixed_pieces_us(kv, n)
            del kv, out, src_b, out_b, priv
            eng = await fresh.reopen()
        extra["lock_stats_last"] = eng.stats().get("lock")
    finally:
        await fresh.close()
        base.close()
    return {"rows": rows, "phases": phases, **extra}
