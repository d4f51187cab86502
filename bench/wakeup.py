"""Wake-up latency of a waiting consumer: the doorbell against its own floor, in one run.

Issue 13, point 3: a consumer waiting on a block wakes <= 20 us p50 after its publication. This
bench separates the doorbell's floor from what the engine adds:

  raw         two processes, no engine: B (uvloop) has an abstract-namespace Unix datagram
              socket in its selector; A stamps ``perf_counter_ns()`` and sends; B stamps in the
              reader callback. The floor of any selector-based wake-up on this host.
  raw_gil     the same, with a second Python thread in B that runs short bursts of Python
              (~50 us each, then a 200 us sleep): what a process pays when another of its
              threads holds the GIL as the datagram lands (the engine's heartbeat and lock
              manager threads are such threads).
  raw_qos     ``raw`` while this process holds a 0 us PM QoS request on /dev/cpu_dma_latency
              (no CPU enters a deep idle state meanwhile): how much of the floor is the idle
              core's exit latency. Skipped where the file cannot be opened (not root).
  engine      A ``put_kv``s one 64 KiB block that B's ``get_kv`` waits for; A's ``publish``
              stamp (just before the layer bits / READY are set) against B's ``woken`` stamp
              (its doorbell callback finished the wait: the re-read of the index included),
              both from ``Engine.time_phases``. Twice: B is the lock manager's node (it created
              the region), and B is not; ``engine_peer_qos`` as the latter with both engines
              opened with ``cpu_wake_latency_us=0`` (``tract_async/host/cpu_qos.py``).

Each case: ``--n`` wake-ups, 2 ms apart (the consumer is asleep each time). Prints p50/p90/p99
and writes ``bench/results/wakeup-<time>-<commit>.json`` with every sample and the machine.

Usage: python bench/wakeup.py [--n 400] [--only raw,raw_gil,engine_mgr,engine_peer]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import _procs  # noqa: E402

import tract_async as tract  # noqa: E402
from tract_async.host.cpu_qos import CpuLatencyRequest  # noqa: E402

GAP_S = 0.002
CASES = ("raw", "raw_gil", "raw_qos", "engine_mgr", "engine_peer", "engine_peer_qos")


def _gil_churn(stop: threading.Event) -> None:
    while not stop.is_set():
        t_end = time.perf_counter() + 50e-6
        x = 0
        while time.perf_counter() < t_end:
            x += 1
        time.sleep(200e-6)


def _raw_consumer(name: bytes, n: int, churn: bool, conn: Connection, res: Connection) -> None:
    async def main() -> list[int]:
        rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        rx.bind(name)
        loop = asyncio.get_running_loop()
        got: list[int] = []
        done = loop.create_future()

        def on_ring() -> None:
            t = time.perf_counter_ns()
            while True:
                try:
                    d = rx.recv(32)
                except BlockingIOError:
                    break
                got.append(t - int(d))
            if len(got) >= n and not done.done():
                done.set_result(None)
        loop.add_reader(rx.fileno(), on_ring)
        stop = threading.Event()
        th = threading.Thread(target=_gil_churn, args=(stop,), daemon=True) if churn else None
        if th is not None:
            th.start()
        conn.send("ready")
        await done
        stop.set()
        loop.remove_reader(rx.fileno())
        rx.close()
        return got
    _procs.send_outcome(res, lambda: tract.run(main()))


def run_raw(n: int, churn: bool) -> list[int] | str:
    ctx = mp.get_context("spawn")
    name = b"\0tract-bench-wake-%s" % uuid.uuid4().hex.encode()
    a, b = ctx.Pipe()
    r, r_child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_raw_consumer, args=(name, n, churn, b, r_child), daemon=True)
    try:
        p.start()
        if not a.poll(60):
            return "raw consumer did not start"
        a.recv()
        tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for _ in range(n):
            time.sleep(GAP_S)
            tx.sendto(b"%d" % time.perf_counter_ns(), name)
        tx.close()
        got = _procs.gather({"consumer": r}, 60, "raw wake-up")
        return got if isinstance(got, str) else got["consumer"]
    finally:
        _procs.reap([p], 10)


def _layout() -> tract.KVLayout:
    return tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=4, head_dim=64, dtype="bfloat16")


QOS_ENV = "TRACT_BENCH_WAKE_QOS"


def _cfg(path: str, node_id: int, create: bool) -> tract.EngineConfig:
    qos = 0 if os.environ.get(QOS_ENV) == "1" else None     # engine_*_qos: the engine's option
    return tract.EngineConfig(layout=_layout(), region=path, region_bytes=256 << 20,
                              create=create, node_id=node_id, namespace="bench-wakeup",
                              mem_backend="hw", cpu_wake_latency_us=qos)


def _key_tokens(i: int) -> list[int]:
    return [i * 16 + t for t in range(16)]


async def _eng_consumer(path: str, node_id: int, create: bool, n: int, conn: Connection,
                        created: Any) -> list[int | None]:
    import torch
    out_woken: list[int | None] = []
    async with tract.Engine.open(_cfg(path, node_id, create)) as eng:
        if create:
            created.set()
        ph = eng.time_phases(True)
        out = torch.empty(_layout().kv_shape(1), dtype=_layout().dtype)
        conn.send("ready")
        for i in range(n):
            keys = eng.block_keys(_key_tokens(i))
            ph.stamps.clear()
            task = asyncio.create_task(eng.get_kv(keys, out=out, timeout=30.0))
            await asyncio.sleep(0)
            conn.send(("waiting", i))
            await task
            out_woken.append(ph.stamps.get("woken"))
        conn.send("done")
        while not conn.poll():           # the producer closes first (the creator closes last)
            await asyncio.sleep(0.01)
        conn.recv()
    return out_woken


async def _recv(conn: Connection, poll_s: float) -> Any:
    while not conn.poll():
        await asyncio.sleep(poll_s)
    return conn.recv()


async def _eng_producer(path: str, node_id: int, create: bool, n: int, conn: Connection,
                        created: Any) -> list[int]:
    import torch
    stamps: list[int] = []
    eng = await tract.Engine.open(_cfg(path, node_id, create))
    try:
        if create:
            created.set()
        ph = eng.time_phases(True)
        kv = torch.ones(_layout().kv_shape(1), dtype=_layout().dtype)
        assert await _recv(conn, 0.001) == "ready"
        for i in range(n):
            keys = eng.block_keys(_key_tokens(i))
            assert await _recv(conn, 0.0005) == ("waiting", i)
            await asyncio.sleep(GAP_S)                # the consumer is asleep in its selector
            await eng.put_kv(keys, kv)
            stamps.append(ph.stamps["publish"])
        assert await _recv(conn, 0.001) == "done"
        if create:                                    # the consumer must detach first
            conn.send("closing")
            await asyncio.sleep(0.5)
    finally:
        if not create:
            await eng.close()
            conn.send("closed")
        else:
            await eng.close()
    return stamps


def _eng_proc(role: str, path: str, node_id: int, create: bool, n: int, conn: Connection,
              created: Any, res: Connection) -> None:
    fn = _eng_consumer if role == "consumer" else _eng_producer
    _procs.send_outcome(res, lambda: tract.run(fn(path, node_id, create, n, conn, created)))


def run_engine(n: int, consumer_is_manager: bool) -> dict[str, Any] | str:
    """One series of engine wake-ups: the region's creator (node 0, the lock manager's node)
    is the consumer (``consumer_is_manager``) or the producer."""
    ctx = mp.get_context("spawn")
    path = f"/dev/shm/tract-bench-wake-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    a, b = ctx.Pipe()
    created = ctx.Event()
    rc, rc_child = ctx.Pipe(duplex=False)
    rp, rp_child = ctx.Pipe(duplex=False)
    cons_node = 0 if consumer_is_manager else 1
    first, second = (("consumer", a, rc_child), ("producer", b, rp_child))
    if not consumer_is_manager:
        first, second = second, first
    procs: list[Any] = []
    try:
        role, conn, res = first
        p1 = ctx.Process(target=_eng_proc, args=(role, path, 0, True, n, conn, created, res),
                         daemon=True)
        p1.start()
        procs.append(p1)
        if not created.wait(120):
            return f"the {role} did not create the region within 120 s"
        role, conn, res = second
        p2 = ctx.Process(target=_eng_proc, args=(role, path, 1, False, n, conn, created, res),
                         daemon=True)
        p2.start()
        procs.append(p2)
        got = _procs.gather({"producer": rp, "consumer": rc}, 300, "engine wake-up")
        if isinstance(got, str):
            return got
        pub, woken = got["producer"], got["consumer"]
        lat = [w - p for p, w in zip(pub, woken) if w is not None and w >= p]
        return {"ns": lat, "not_doorbell_woken": sum(1 for p, w in zip(pub, woken)
                                                     if w is None or w < p),
                "consumer_node": cons_node}
    finally:
        _procs.reap(procs, 20)
        if os.path.exists(path):
            os.unlink(path)


def summary(ns: list[int]) -> dict[str, float]:
    us = [x / 1e3 for x in ns]
    return {"n": len(us), "p50_us": C.median(us), "p90_us": C.pct(us, 90), "p99_us": C.pct(us, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--only", default=",".join(CASES))
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"wake-ups: {args.n} per case, {GAP_S * 1e3:.0f} ms apart; {os.cpu_count()} cpus; "
          f"load {load[0]:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for case in [c for c in args.only.split(",") if c]:
        t0 = time.monotonic()
        with CpuLatencyRequest(0) if case.endswith("_qos") else contextlib.nullcontext() as qos:
            if qos is not None and not qos.held:
                print(f"  {case}: skipped (PM QoS: {qos.why_not})", flush=True)
                rows.append({"case": case, "error": f"no PM QoS: {qos.why_not}"})
                continue
            if case.startswith("raw"):
                got: Any = run_raw(args.n, churn=case == "raw_gil")
                ns = got if isinstance(got, list) else None
                extra: dict[str, Any] = {}
            else:
                qos.release() if qos is not None else None     # the engines hold their own
                os.environ[QOS_ENV] = "1" if case.endswith("_qos") else "0"
                got = run_engine(args.n, consumer_is_manager=case.startswith("engine_mgr"))
                ns = got["ns"] if isinstance(got, dict) else None
                extra = ({"not_doorbell_woken": got["not_doorbell_woken"]}
                         if isinstance(got, dict) else {})
        print(f"  {case}: {time.monotonic() - t0:.1f} s" + ("" if ns else f" ({got})"), flush=True)
        if not ns:
            rows.append({"case": case, "error": str(got)})
            continue
        raw[case] = ns
        rows.append({"case": case, **summary(ns), **extra})
    base = next((r["p50_us"] for r in rows if r["case"] == "raw" and "p50_us" in r), None)
    for r in rows:
        if base and "p50_us" in r:
            r["x_raw_p50"] = r["p50_us"] / base
    print(C.table(rows, ["case", "n", "p50_us", "p90_us", "p99_us", "x_raw_p50",
                         "not_doorbell_woken"]))
    for r in rows:
        if r["case"].startswith("engine") and "p50_us" in r:
            ok = r["p50_us"] <= 20
            print(f"target {r['case']}: publish -> woken p50 {r['p50_us']:.1f} us (<= 20 us): "
                  f"{'MET' if ok else 'MISSED'}")
    path = C.write_json("wakeup", {"args": vars(args), "load_before": load, "rows": rows,
                                   "samples_ns": raw})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
