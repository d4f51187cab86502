"""Part 2 of ``bench/putget.py``: a handoff between two processes, the engine against NIXL.

Engine: node 0 (the consumer) creates the region, so it is the lowest node and runs the lock
manager; node 1 (the producer) attaches. Per handoff the consumer starts a ``get_kv(...,
timeout=...)`` and says it waits; the producer stamps ``perf_counter_ns()`` just before
``put_kv``, the consumer when ``get_kv`` returned (CLOCK_MONOTONIC: one clock for both). NIXL
runs the same cases through ``bench/_nixl.py`` (a WRITE with a notification; that module says why
it is the faithful and strongest equivalent).
"""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

import _common as C
import _nixl
import _procs
import tract_async as tract

from _putget.fixtures import (BLOCK, KiB, LAYOUT, MiB, REGION_OVERHEAD, det_keys, engine_cfg,
                              make_kv, shm_path)


REGION_HANDOFFS = 8
"""The handoff region holds this many handoffs of the largest case (1 GiB of payload in a full
run). Until 2026-12-04 it held two, and the producer reopened its engine at every second
128 MiB handoff: half of those puts claimed 64 fresh chunks under the lock, a cost that a
serving node with a region of many handoffs pays once. A full cache instead evicts (the
eviction's own cost is measured apart: README, "Caveats")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One series of handoffs of ``nbytes`` each: ``warm`` untimed, then ``count`` timed."""

    label: str
    nbytes: int
    count: int
    warm: int
    delay_s: float  # the producer waits this long after hearing that the consumer waits
    mode: str       # "block": one put_kv / get_kv of all layers; "layers": one call per layer

    @property
    def nixl_key(self) -> str:
        """NIXL does not stream layers: the block and the layers case of a size share one run."""
        return self.label.rsplit("-", 1)[0] if self.nbytes > 64 * KiB else self.label


async def arecv(conn: Connection) -> Any:
    """Receive from a Pipe without blocking the event loop (the engine's tasks keep running)."""
    if not conn.poll():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


async def _consume(path: str, region_bytes: int, cases: list[Case], conn: Connection
                   ) -> dict[str, Any]:
    out_t: dict[str, list[int]] = {}
    woken: dict[str, list[int | None]] = {}
    async with tract.Engine.open(engine_cfg(path, 0, region_bytes, True)) as eng:
        ph = eng.time_phases(True)       # its "woken" stamp: when a doorbell ring ended a wait
        conn.send("ready")
        for c in cases:
            n = c.nbytes // BLOCK
            out = torch.empty(LAYOUT.kv_shape(n), dtype=LAYOUT.dtype)
            ob = out.view(-1).view(torch.uint8)
            t1s = []
            woken[c.label] = []
            for i in range(c.warm + c.count):
                keys = det_keys(c.label, i, n)
                await arecv(conn)                   # "go": the producer has room for it
                ph.stamps.clear()

                async def get_all() -> int:
                    if c.mode == "block":
                        await eng.get_kv(keys, out=out, timeout=30.0)
                    else:
                        for layer in range(LAYOUT.num_layers):
                            await eng.get_kv(keys, layer=layer, out=out[layer], timeout=30.0)
                    return time.perf_counter_ns()
                task = asyncio.create_task(get_all())
                await asyncio.sleep(0)              # the get has looked once and is waiting
                conn.send(("waiting", i))
                t1 = await task
                if int(ob[0]) != (i & 0xFF) or int(ob[-1]) != (i & 0xFF):
                    raise RuntimeError(f"{c.label} handoff {i}: wrong bytes")
                conn.send(("done", i))
                if i >= c.warm:
                    t1s.append(t1)
                    woken[c.label].append(ph.stamps.get("woken"))
            out_t[c.label] = t1s
        st = eng.stats()
        await arecv(conn)                           # the producer has closed: now we may
        return {"t1": out_t, "woken": woken,
                "stats": {k: st[k] for k in ("hits", "layer_waits", "gets", "is_lock_manager",
                                             "doorbell_wakes") if k in st}}


async def _produce(path: str, region_bytes: int, cases: list[Case], conn: Connection
                   ) -> dict[str, Any]:
    cfg = engine_cfg(path, 1, region_bytes, False)
    eng = await tract.Engine.open(cfg)
    usable = region_bytes - REGION_OVERHEAD
    used, reopens = 0, 0
    pstats: dict[str, float] = {}
    t0s: dict[str, list[int]] = {}
    put_s: dict[str, list[float]] = {}
    lock_wait: dict[str, list[float]] = {}
    published: dict[str, list[int]] = {}
    try:
        for c in cases:
            n = c.nbytes // BLOCK
            kv = make_kv(n)
            kb = kv.view(-1).view(torch.uint8)
            t0s[c.label], put_s[c.label], lock_wait[c.label] = [], [], []
            published[c.label] = []
            for i in range(c.warm + c.count):
                if used + c.nbytes > usable:         # close evicts our blocks: room again
                    _add_stats(pstats, eng.stats())
                    await eng.close()
                    eng = await tract.Engine.open(cfg)
                    used, reopens = 0, reopens + 1
                ph = eng.time_phases(True)           # its "publish" stamp (the last layer's)
                keys = det_keys(c.label, i, n)
                kb[0] = kb[-1] = i & 0xFF
                # read before "go": between the consumer's "waiting" and the put nothing but the
                # wake-up may run (eng.stats() builds a dict of ~100 entries: tens of µs that
                # the consumer would spend waiting, past its spin, on the producer's bookkeeping)
                lw0 = eng.stats()["lock_wait_s"]
                conn.send(("go", i))
                await arecv(conn)                    # the consumer is waiting
                if c.delay_s:
                    await asyncio.sleep(c.delay_s)
                t0 = time.perf_counter_ns()
                if c.mode == "block":
                    await eng.put_kv(keys, kv)
                else:
                    for layer in range(LAYOUT.num_layers):
                        await eng.put_kv(keys, kv[layer], layer=layer)
                t_end = time.perf_counter_ns()
                used += c.nbytes
                await arecv(conn)                    # the consumer has its bytes
                if i >= c.warm:
                    t0s[c.label].append(t0)
                    put_s[c.label].append((t_end - t0) / 1e9)
                    lock_wait[c.label].append(eng.stats()["lock_wait_s"] - lw0)
                    published[c.label].append(ph.stamps["publish"])
    finally:
        try:
            _add_stats(pstats, eng.stats())
        except Exception:  # noqa: BLE001 - a failed run reports its own error
            pass
        await eng.close()
        conn.send("closed")
    return {"t0": t0s, "put_s": put_s, "lock_wait_s": lock_wait, "reopens": reopens,
            "stats": pstats,
            "published": published}


PRODUCER_STATS = ("puts", "lock_acquisitions", "lockfree_reservations", "preclaimed_chunks",
                  "lock_wait_s", "evictions", "evicted_ahead")


def _add_stats(acc: dict[str, float], st: dict[str, Any]) -> None:
    """Sum the producer's counters over its engines (it reopens one when the region fills)."""
    for k in PRODUCER_STATS:
        if k in st:
            acc[k] = acc.get(k, 0) + st[k]


def _eng_consumer(path: str, region_bytes: int, cases: list[Case], conn: Connection,
                  res: Connection) -> None:
    """Node 0: creates the region, waits for each handoff's bytes and stamps their arrival."""
    _procs.send_outcome(res, lambda: tract.run(_consume(path, region_bytes, cases, conn)))


def _eng_producer(path: str, region_bytes: int, cases: list[Case], conn: Connection,
                  res: Connection) -> None:
    """Node 1: puts each block after hearing that the consumer waits for it."""
    _procs.send_outcome(res, lambda: tract.run(_produce(path, region_bytes, cases, conn)))


def engine_handoff(cases: list[Case], timeout_s: float = 300.0) -> dict[str, Any] | str:
    """Handoff, put and after-put seconds per case label, or a line saying why it did not run."""
    # room for REGION_HANDOFFS of the largest case: the producer reopens its engine when the
    # region is full (close evicts its blocks), and the first put after a reopen claims every
    # chunk it needs under the lock; the pre-claim task serves the puts after it
    region_bytes = REGION_HANDOFFS * max(c.nbytes for c in cases) + REGION_OVERHEAD
    path = shm_path("handoff")
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    rc, rc_child = ctx.Pipe(duplex=False)
    rp, rp_child = ctx.Pipe(duplex=False)
    cons = ctx.Process(target=_eng_consumer, args=(path, region_bytes, cases, a, rc_child), daemon=True)
    prod = None
    try:
        cons.start()
        if not b.poll(120):
            return "engine handoff: the consumer did not open its engine within 120 s"
        b.recv()
        prod = ctx.Process(target=_eng_producer, args=(path, region_bytes, cases, b, rp_child),
                           daemon=True)
        prod.start()
        got = _procs.gather({"producer": rp, "consumer": rc}, timeout_s, "engine handoff")
        if isinstance(got, str):
            return got
        p, c = got["producer"], got["consumer"]
        hand = {k: [(x1 - x0) / 1e9 for x0, x1 in zip(p["t0"][k], c["t1"][k])] for k in p["t0"]}
        after = {k: [(x1 - x0) / 1e9 - d for x0, x1, d in zip(p["t0"][k], c["t1"][k], p["put_s"][k])]
                 for k in p["t0"]}
        # the last publish -> the consumer's doorbell callback finished its wait; a wait that
        # ended before it (an earlier layer's ring, the last layer then found at once) or on a
        # timer (no stamp) is counted apart, not as a wake-up
        wake = {k: [(w - x) / 1e9 for x, w in zip(p["published"][k], c["woken"][k])
                    if w and w >= x] for k in p["t0"]}
        timer_woken = {k: sum(1 for x, w in zip(p["published"][k], c["woken"][k])
                              if not w or w < x) for k in p["t0"]}
        return {"handoff_s": hand, "after_put_s": after, "put_s": p["put_s"], "lock_wait_s": p["lock_wait_s"],
                "wake_s": wake, "not_doorbell_woken": timer_woken,
                "producer_reopens": p["reopens"], "producer_stats": p["stats"],
                "consumer_stats": c["stats"]}
    finally:
        _procs.reap((prod, cons), 20)
        if os.path.exists(path):
            os.unlink(path)


def handoff_cases(quick: bool) -> list[Case]:
    """64 KiB hot and after a 1 ms wait (p50/p99 over hundreds); 16/64/128 MiB as one block and
    layer by layer (bandwidth). --quick: fewer 64 KiB handoffs, 16 MiB only."""
    n64 = 60 if quick else 300
    big = [(16 * MiB, 4 if quick else 20, 1)] + ([] if quick else [(64 * MiB, 8, 1), (128 * MiB, 6, 1)])
    cases = [Case(label="64K-hot", nbytes=64 * KiB, count=n64, warm=10, delay_s=0.0, mode="block"),
             Case(label="64K-wait1ms", nbytes=64 * KiB, count=n64, warm=10, delay_s=0.001,
                  mode="block")]
    for nb, cnt, w in big:
        for mode in ("block", "layers"):
            cases.append(Case(label=f"{C.human_bytes(nb).replace(' ', '')}-{mode}", nbytes=nb,
                              count=cnt, warm=w, delay_s=0.001, mode=mode))
    return cases


def nixl_cases(cases: list[Case]) -> list[tuple[str, int, int, int, float]]:
    """``_nixl.handoff``'s cases: one per ``nixl_key``, in order of first appearance."""
    out, seen = [], set()
    for c in cases:
        if c.nixl_key not in seen:
            seen.add(c.nixl_key)
            out.append((c.nixl_key, c.nbytes, c.count, c.warm, c.delay_s))
    return out


def case_row(c: Case, systems: dict[str, Any]) -> dict[str, Any]:
    """One row of the handoff table: the engine's figures, NIXL's, and the engine/NIXL ratios."""
    row: dict[str, Any] = {"case": c.label, "size": C.human_bytes(c.nbytes), "bytes": c.nbytes,
                           "n": c.count, "consumer_waits_ms": c.delay_s * 1e3, "mode": c.mode}
    eng = systems["engine"]
    if isinstance(eng, dict):
        h = eng["handoff_s"][c.label]
        row.update({"eng_p50_us": C.median(h) * 1e6, "eng_p99_us": C.pct(h, 99) * 1e6,
                    "eng_GBps": c.nbytes / C.median(h) / 1e9,
                    "eng_put_p50_us": C.median(eng["put_s"][c.label]) * 1e6,
                    "eng_after_put_p50_us": C.median(eng["after_put_s"][c.label]) * 1e6,
                    "eng_lock_wait_p50_us": C.median(eng["lock_wait_s"][c.label]) * 1e6,
                    "eng_wake_p50_us": (C.median(eng["wake_s"][c.label]) * 1e6
                                        if eng["wake_s"][c.label] else None),
                    "eng_wake_p99_us": (C.pct(eng["wake_s"][c.label], 99) * 1e6
                                        if eng["wake_s"][c.label] else None),
                    "eng_not_bell_woken": eng["not_doorbell_woken"][c.label]})
    for name in ("nixl_shm", "nixl_tcp"):
        res = systems[name]
        short = name.split("_")[1]
        if isinstance(res, dict) and c.nixl_key in res:
            h = res[c.nixl_key]
            row[f"{short}_p50_us"] = C.median(h) * 1e6
            row[f"{short}_p99_us"] = C.pct(h, 99) * 1e6
            row[f"{short}_GBps"] = c.nbytes / C.median(h) / 1e9
            if "eng_p50_us" in row:
                row[f"eng/{short}_time"] = row["eng_p50_us"] / row[f"{short}_p50_us"]
    return row


def part_handoff(quick: bool, with_nixl: bool) -> dict[str, Any]:
    """Rows per case, every handoff sample per system, and what was not measured and why."""
    cases = handoff_cases(quick)
    print("  engine (producer node 1, consumer node 0) ...", flush=True)
    eng = engine_handoff(cases)
    if isinstance(eng, dict):
        print(f"  producer counters: {eng['producer_stats']}", flush=True)
    systems: dict[str, Any] = {"engine": eng}
    for name, tls in (("nixl_shm", "shm,cma,tcp"), ("nixl_tcp", "tcp")):
        if not with_nixl:
            systems[name] = "skipped (--no-nixl)"
            continue
        print(f"  {name} (UCX_TLS={tls}) ...", flush=True)
        systems[name] = _nixl.handoff(tls, nixl_cases(cases))
    rows = [case_row(c, systems) for c in cases]
    raw = {name: (res if isinstance(res, str) else
                  dict(res["handoff_s"] if name == "engine" else res))
           for name, res in systems.items()}
    extra = {k: v for k, v in eng.items() if k != "handoff_s"} if isinstance(eng, dict) else {}
    return {"rows": rows, "raw_handoff_s": raw, "engine_detail": extra,
            "not_measured": {k: v for k, v in systems.items() if isinstance(v, str)}}
