"""Transport benchmark: one READ at a time, 4 KiB to 128 MiB, every network transport in one run.

Systems, each as two spawned processes (a target that holds the memory, an initiator that READs
it), medians of repeated READs, the same sizes and the same machine in the same run:

  agent         our HTTP Agent (transport.http) on uvloop: a signed POST, the body written by the
                kernel straight into the destination (transport/conn.py)
  aiohttp       bare aiohttp on uvloop, the floor of the agent: a handler that answers a POST with
                n bytes of a preallocated buffer, a ClientSession that reads the body (no
                signature, no descriptors, no direct write)
  nixl          our NixlAgent (transport.nixl_agent) on uvloop: ``await agent.transfer(x)``; the
                target progresses from its event loop, kept hot as a store keeps it while peers
                read (``keep_hot``)
  nixl_bare     NIXL's own Python API, both sides busy-polling (the target ``get_new_notifs``,
                the initiator ``check_xfer_state``): the strongest form of bare NIXL
  nixl_pthread  our NixlAgent with NIXL's progress thread (``progress_thread=True``), target cold

Extras, same run: a 4 KiB READ after 30 ms of idle (a *cold* target), each target's CPU while
idle, and the longest stall of our NIXL target's event loop while it served the sweep.
Targets: nixl within 1.2x of nixl_bare at every size (median latency); the agent's 4 KiB and
32 KiB p50 within 1.5x of bare aiohttp. The JSON (``bench/results/transport-<time>.json``) keeps
every sample and the machine.

Each target runs on CPU 0, each initiator on CPU 1 (``_pinned`` says why). UCX runs on loopback only (``UCX_NET_DEVICES=lo``) with ``UCX_TLS=tcp``, the NixlAgent's default
on a host without CUDA. ``--gpu`` (for the H200; this development VM has no GPU) puts both
sides' buffers in GPU memory (VRAM) for the NIXL systems and the agent, and UCX_TLS=tcp,cuda_copy.

Usage: python bench/transport.py [--quick] [--max-mib 128] [--only nixl,nixl_bare] [--gpu]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _nixl  # noqa: E402

SECRET = b"bench-secret-0123456789abcdef!!"
KiB, MiB = 1 << 10, 1 << 20
SYSTEMS = ("agent", "aiohttp", "nixl", "nixl_bare", "nixl_pthread")
COLD_GAP_S = 0.03
COLD_SAMPLES = 20


def sizes_for(max_bytes: int) -> list[int]:
    out, n = [], 4 * KiB
    while n <= max_bytes:
        out.append(n)
        n *= 8
    if out[-1] != max_bytes:
        out.append(max_bytes)
    return out


ROUNDS = int(os.environ.get("TRACT_BENCH_ROUNDS", "1"))   # --rounds (spawned processes inherit it)


def iters_for(nbytes: int, quick: bool) -> int:
    # enough samples for a stable median; bounded bytes per size (~1 GiB, ~256 MiB quick)
    budget = (256 if quick else 1024) * MiB
    return max(5, min(50 if quick else 200, budget // nbytes) // ROUNDS)


def buffer(nbytes: int, fill: int, gpu: bool) -> Any:
    """The memory one side registers: a CPU tensor, or with ``gpu`` one in GPU memory."""
    import torch
    t = torch.full((nbytes,), fill, dtype=torch.uint8)
    return t.cuda() if gpu else t


def last_byte(buf: Any, n: int) -> int:
    return int(buf[n - 1].item()) if hasattr(buf, "item") else int(buf[n - 1])


def cpu_while_idle(seconds: float = 1.0) -> float:
    """This process's CPU over ``seconds`` of wall time, in cores (call from a thread: the
    process keeps doing whatever it does while idle)."""
    t0, w0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return (time.process_time() - t0) / (time.monotonic() - w0)


def _env(gpu: bool) -> None:
    import logging
    _nixl.nixl_env("tcp,cuda_copy" if gpu else "tcp")
    logging.getLogger("nixl").setLevel(logging.WARNING)     # its INFO lines on every agent


def _measure(once: Callable[[], Any], n: int, quick: bool) -> Any:
    """An async sampler: 3 warm-ups, then ``iters_for`` timed calls of ``await once()``."""
    async def run() -> list[float]:
        for _ in range(3):
            await once()
        out = []
        for _ in range(iters_for(n, quick)):
            t0 = time.perf_counter()
            await once()
            out.append(time.perf_counter() - t0)
        return out
    return run()


async def _cold(once: Callable[[], Any], ctl: Any) -> list[float]:
    """4 KiB READs after COLD_GAP_S of idle each, the target told to cool down first."""
    ctl.send("cool")
    ctl.recv()
    out = []
    for _ in range(COLD_SAMPLES):
        await asyncio.sleep(COLD_GAP_S)
        t0 = time.perf_counter()
        await once()
        out.append(time.perf_counter() - t0)
    ctl.send("heat")                       # the next sizes measure a target kept hot again
    ctl.recv()
    return out


def _finish(ctl: Any) -> dict[str, Any]:
    """Cool the target down, ask for its CPU while idle, then stop it; its extras."""
    ctl.send("cool")
    ctl.recv()
    ctl.send("idle")
    extras = ctl.recv()
    ctl.send("stop")
    return extras


async def _serve_async(ctl: Any, extras: Callable[[], dict],
                       heat: Callable[[bool], None] = lambda hot: None) -> None:
    """A target's command loop on its event loop: cool / heat / idle / stop."""
    loop = asyncio.get_running_loop()
    while True:
        cmd = await loop.run_in_executor(None, ctl.recv)
        if cmd in ("cool", "heat"):
            heat(cmd == "heat")
            ctl.send("ok")
        elif cmd == "idle":
            ctl.send({**extras(), "idle_cpu_cores": await loop.run_in_executor(None, cpu_while_idle)})
        else:
            return


# --- HTTP agent ---------------------------------------------------------------------------------
def agent_target(max_bytes: int, gpu: bool, md_q: Any, ctl: Any) -> None:
    import uvloop

    async def main() -> None:
        from tract_async.transport.http import Agent
        agent = Agent("target", secret=SECRET)
        agent.register_memory(buffer(max_bytes, 0x5A, gpu), name="src", writable=False)
        await agent.start()
        md_q.put(agent.get_agent_metadata())
        await _serve_async(ctl, dict)
        await agent.close()
    uvloop.run(main())


def agent_initiator(md: bytes, sizes: list[int], quick: bool, gpu: bool, ctl: Any, res_q: Any) -> None:
    import uvloop

    async def main() -> dict[str, Any]:
        from tract_async.transport.http import Agent
        out: dict[str, Any] = {"samples": {}}
        async with Agent("initiator", secret=SECRET) as agent:
            dst = buffer(max(sizes), 0, gpu)
            agent.register_memory(dst)
            peer = agent.add_remote_agent(md)
            src = agent.remote_region(peer, "src")
            for n in sizes:
                h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.data_ptr(), n, max(dst.get_device(), 0))],
                                                                       "VRAM" if gpu else "DRAM"),
                                          agent.get_xfer_descs([src.desc(0, n)], src.mem_type), peer)
                out["samples"][n] = await _measure(lambda: agent.transfer(h, timeout=120), n, quick)
                assert last_byte(dst, n) == 0x5A
                if n == sizes[0]:
                    out["cold_4k"] = await _cold(lambda: agent.transfer(h, timeout=120), ctl)
                h.release()
        out["target"] = _finish(ctl)
        return out
    res_q.put(uvloop.run(main()))


# --- bare aiohttp --------------------------------------------------------------------------------
def aiohttp_target(max_bytes: int, gpu: bool, md_q: Any, ctl: Any) -> None:
    import uvloop

    async def main() -> None:
        from aiohttp import web
        data = memoryview(bytes([0x5A]) * max_bytes)

        async def read(request: web.Request) -> web.Response:
            n = int((await request.read()).decode())
            return web.Response(body=data[:n], content_type="application/octet-stream")

        app = web.Application()
        app.router.add_post("/read", read)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        md_q.put(f"http://127.0.0.1:{runner.addresses[0][1]}/read".encode())
        await _serve_async(ctl, dict)
        await runner.cleanup()
    uvloop.run(main())


def aiohttp_initiator(url: bytes, sizes: list[int], quick: bool, gpu: bool, ctl: Any, res_q: Any) -> None:
    import uvloop

    async def main() -> dict[str, Any]:
        import aiohttp
        out: dict[str, Any] = {"samples": {}}
        connector = aiohttp.TCPConnector(limit_per_host=8)
        async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20,
                                         auto_decompress=False) as s:
            for n in sizes:
                body = str(n).encode()

                async def once() -> None:
                    async with s.post(url.decode(), data=body) as r:
                        got = await r.read()
                    assert len(got) == n

                out["samples"][n] = await _measure(once, n, quick)
                if n == sizes[0]:
                    out["cold_4k"] = await _cold(once, ctl)
        out["target"] = _finish(ctl)
        return out
    res_q.put(uvloop.run(main()))


# --- our NixlAgent -------------------------------------------------------------------------------
def nixl_target(max_bytes: int, gpu: bool, md_q: Any, ctl: Any, progress_thread: bool = False) -> None:
    _env(gpu)
    import uvloop

    async def main() -> None:
        from tract_async.transport.nixl_agent import NixlAgent
        agent = NixlAgent("target", progress_thread=progress_thread)
        src = buffer(max_bytes, 0x5A, gpu)
        info = agent.register_memory(src, name="src", writable=False)
        await agent.start()
        def heat(hot: bool) -> None:          # hot as a store keeps it while its peers read
            if progress_thread:
                return
            if hot:
                agent.keep_hot(3600.0)
            else:
                agent.cool_down()

        heat(True)
        lag = {"max_s": 0.0, "samples": []}

        async def watch() -> None:           # how long the loop stalls (a NIXL poll drains)
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                d = time.perf_counter() - t0 - 0.001
                lag["max_s"] = max(lag["max_s"], d)
                lag["samples"].append(d)

        watcher = asyncio.get_running_loop().create_task(watch())
        md_q.put((agent.get_agent_metadata(), info))

        def extras() -> dict:
            watcher.cancel()                  # before the idle-CPU reading: it wakes 1000x a second
            s = sorted(lag["samples"]) or [0.0]
            return {"loop_lag_max_s": lag["max_s"], "loop_lag_p99_s": s[int(0.99 * (len(s) - 1))],
                    "agent": agent.describe()}

        await _serve_async(ctl, extras, heat)
        await agent.close()
    uvloop.run(main())


def nixl_pthread_target(max_bytes: int, gpu: bool, md_q: Any, ctl: Any) -> None:
    nixl_target(max_bytes, gpu, md_q, ctl, progress_thread=True)


def nixl_initiator(md: tuple, sizes: list[int], quick: bool, gpu: bool, ctl: Any, res_q: Any,
                   progress_thread: bool = False) -> None:
    _env(gpu)
    import uvloop

    async def main() -> dict[str, Any]:
        from tract_async.transport.descs import XferDescList
        from tract_async.transport.nixl_agent import NixlAgent
        out: dict[str, Any] = {"samples": {}}
        agent = NixlAgent("initiator", progress_thread=progress_thread)
        dst = buffer(max(sizes), 0, gpu)
        mine = agent.register_memory(dst, name="dst")
        await agent.start()
        peer_md, info = md
        peer = agent.add_remote_agent(peer_md, regions=[info])
        for n in sizes:
            x = agent.initialize_xfer("READ", XferDescList([mine.desc(0, n)], mine.mem_type),
                                      XferDescList([info.desc(0, n)], info.mem_type), peer)
            spin0 = agent.stats["spin_done"]
            out["samples"][n] = await _measure(lambda: agent.transfer(x, timeout=120), n, quick)
            out.setdefault("spin_done", {})[n] = agent.stats["spin_done"] - spin0
            assert last_byte(dst, n) == 0x5A
            if n == sizes[0]:
                out["cold_4k"] = await _cold(lambda: agent.transfer(x, timeout=120), ctl)
            x.release()
        out["target"] = _finish(ctl)
        await agent.close()
        return out
    res_q.put(uvloop.run(main()))


def nixl_pthread_initiator(md: tuple, sizes: list[int], quick: bool, gpu: bool, ctl: Any,
                           res_q: Any) -> None:
    nixl_initiator(md, sizes, quick, gpu, ctl, res_q, progress_thread=True)


# --- bare NIXL -------------------------------------------------------------------------------------
def nixl_bare_target(max_bytes: int, gpu: bool, md_q: Any, ctl: Any) -> None:
    _env(gpu)
    agent = _nixl.make_agent("target")
    src = buffer(max_bytes, 0x5A, gpu)
    mem = "VRAM" if gpu else "DRAM"
    reg = agent.register_memory([(src.data_ptr(), max_bytes, max(src.get_device(), 0), "")], mem)
    md_q.put((agent.get_agent_metadata(), src.data_ptr(), max(src.get_device(), 0), mem))
    # the target must progress for UCX to serve READs over TCP: busy-poll, as NIXL's examples do
    while True:
        agent.get_new_notifs()
        if ctl.poll():
            cmd = ctl.recv()
            if cmd in ("cool", "heat"):
                ctl.send("ok")
            elif cmd == "idle":
                t0, w0 = time.process_time(), time.monotonic()
                while time.monotonic() - w0 < 1.0:
                    agent.get_new_notifs()
                ctl.send({"idle_cpu_cores": (time.process_time() - t0) / (time.monotonic() - w0)})
            else:
                break
    agent.deregister_memory(reg)


def nixl_bare_initiator(md: tuple, sizes: list[int], quick: bool, gpu: bool, ctl: Any, res_q: Any) -> None:
    _env(gpu)
    agent = _nixl.make_agent("initiator")
    peer_md, src_addr, src_dev, mem = md
    dst = buffer(max(sizes), 0, gpu)
    dev = max(dst.get_device(), 0)
    reg = agent.register_memory([(dst.data_ptr(), max(sizes), dev, "")], mem)
    peer = agent.add_remote_agent(peer_md)
    out: dict[str, Any] = {"samples": {}}

    def once(h: Any, n: int) -> None:
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL READ of {n} bytes: {state}")

    async def wrap(h: Any, n: int) -> None:
        once(h, n)

    async def main() -> None:
        for n in sizes:
            h = None
            deadline = time.monotonic() + 60
            while h is None:   # the remote metadata may take a moment to be usable
                try:
                    h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.data_ptr(), n, dev)], mem),
                                              agent.get_xfer_descs([(src_addr, n, src_dev)], mem), peer)
                except Exception:  # noqa: BLE001
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            out["samples"][n] = await _measure(lambda: wrap(h, n), n, quick)
            assert last_byte(dst, n) == 0x5A
            if n == sizes[0]:
                out["cold_4k"] = await _cold(lambda: wrap(h, n), ctl)
            agent.release_xfer_handle(h)

    asyncio.run(main())
    out["target"] = _finish(ctl)
    agent.deregister_memory(reg)
    res_q.put(out)


# --- harness ---------------------------------------------------------------------------------------
PAIRS: dict[str, tuple[Callable, Callable]] = {
    "agent": (agent_target, agent_initiator),
    "aiohttp": (aiohttp_target, aiohttp_initiator),
    "nixl": (nixl_target, nixl_initiator),
    "nixl_bare": (nixl_bare_target, nixl_bare_initiator),
    "nixl_pthread": (nixl_pthread_target, nixl_pthread_initiator),
}


def _pinned(cpu: int, fn: Callable, *args: Any) -> None:
    """Run ``fn`` on one CPU. Both sides of the NIXL systems busy-poll: on two cores the
    scheduler sometimes put both pollers on one core (and left them there), and every READ then
    waited for a tick to switch between them, 4-8 ms (seen on both our and bare NIXL, in
    alternate runs); one side per core removes that."""
    if (os.cpu_count() or 1) > cpu:
        os.sched_setaffinity(0, {cpu})
    fn(*args)


def _get_watching(q: Any, procs: list[Any], timeout: float) -> Any:
    """``q.get`` that gives up as soon as one of ``procs`` has died, instead of waiting out the
    whole timeout (a child that failed at import, say, would otherwise hold a run for 15 minutes
    and leave nothing but its traceback)."""
    import queue as _queue
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=1.0)
        except _queue.Empty:
            dead = [p for p in procs if p is not None and p.exitcode is not None]
            if dead:
                try:                      # a child that exited after its put: the item is in flight
                    return q.get(timeout=5.0)
                except _queue.Empty:
                    pass
                raise RuntimeError("child process exited early: "
                                   + ", ".join(f"pid {p.pid} rc={p.exitcode}" for p in dead))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result within {timeout:.0f} s") from None


def run_system(name: str, sizes: list[int], quick: bool, gpu: bool,
               rounds: int = 1) -> dict[str, Any] | str:
    """One system's samples and extras, or a string saying exactly why it did not run."""
    if name.startswith("nixl") and (why := _nixl.available()):
        return why
    target_fn, initiator_fn = PAIRS[name]
    ctx = mp.get_context("spawn")
    md_q, res_q = ctx.Queue(), ctx.Queue()
    ctl_t, ctl_i = ctx.Pipe()
    os.environ["TRACT_BENCH_ROUNDS"] = str(rounds)       # the spawned processes' iters_for
    tgt = ctx.Process(target=_pinned, args=(0, target_fn, max(sizes), gpu, md_q, ctl_t), daemon=True)
    tgt.start()
    ini = None
    try:
        md = _get_watching(md_q, [tgt], 120)
        ini = ctx.Process(target=_pinned, args=(1, initiator_fn, md, sizes, quick, gpu, ctl_i, res_q),
                          daemon=True)
        ini.start()
        return _get_watching(res_q, [tgt, ini], 900)
    except Exception as e:  # noqa: BLE001 - the reason goes into the table and the JSON
        return f"{name} did not run: {type(e).__name__}: {e}"
    finally:
        for p in (ini, tgt):
            if p is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()


def auth_cost_us() -> dict[str, float]:
    """What the agent adds per request that bare aiohttp does not: signing and verifying."""
    from tract_async.transport import wire
    from tract_async.transport.auth import Signer, Verifier, new_instance
    inst = new_instance()
    s, v = Signer("a", SECRET), Verifier(SECRET, name="b", instance=inst)
    doc = wire.encode_doc([[1 << 40, 4096, 0]], "DRAM", b"")
    n = 2000
    t0 = time.perf_counter()
    hs = [s.headers("POST", wire.PATH_READ, doc, to="b", to_instance=inst) for _ in range(n)]
    t1 = time.perf_counter()
    for h in hs:
        v.verify("POST", wire.PATH_READ, h, doc)
    t2 = time.perf_counter()
    return {"sign_us": (t1 - t0) / n * 1e6, "verify_us": (t2 - t1) / n * 1e6}


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def fmt_lat(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--max-mib", type=int, default=128)
    ap.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    ap.add_argument("--gpu", action="store_true", help="buffers in GPU memory (the H200)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems this many times, interleaved (a shared machine's load "
                         "moves between systems otherwise); samples are merged")
    args = ap.parse_args()
    sizes = sizes_for(args.max_mib * MiB)
    names = [s for s in args.only.split(",") if s]
    if args.gpu:
        names = [s for s in names if s != "aiohttp"]   # no GPU memory there
    load_before = os.getloadavg()
    systems: dict[str, dict[str, Any] | str] = {}
    print(f"sizes: {[fmt_size(s) for s in sizes]}; systems: {names}; load {load_before}", flush=True)
    per_round: dict[str, list[dict[int, float]]] = {}
    for r in range(args.rounds):
        for name in names:
            if isinstance(systems.get(name), str):
                continue
            t0 = time.monotonic()
            got = run_system(name, sizes, args.quick, args.gpu, args.rounds)
            print(f"  {name} (round {r + 1}): {time.monotonic() - t0:.1f} s"
                  + ("" if isinstance(got, dict) else f" ({got})"), flush=True)
            if isinstance(got, str):
                systems[name] = got
                continue
            per_round.setdefault(name, []).append({n: statistics.median(got["samples"][n]) for n in sizes})
            if name not in systems:
                systems[name] = got
            else:
                for n in sizes:
                    systems[name]["samples"][n] += got["samples"][n]

    def med(name: str, n: int) -> float | None:
        r = systems.get(name)
        return statistics.median(r["samples"][n]) if isinstance(r, dict) else None

    rows = []
    for n in sizes:
        row: dict[str, Any] = {"bytes": n}
        for name in names:
            r = systems[name]
            if isinstance(r, dict):
                xs = r["samples"][n]
                row[name] = {"p50_s": statistics.median(xs), "p99_s": _common.pct(xs, 99),
                             "gbps": n / statistics.median(xs) / 1e9, "samples": len(xs)}
        # ratios per round (the two systems ran back to back, under the same load), then the
        # median over rounds: a shared machine's load moves between rounds more than between
        # neighbours, and pooled samples mix the rounds' regimes
        for key, a, b in (("nixl_vs_bare", "nixl", "nixl_bare"),
                          ("nixl_pthread_vs_bare", "nixl_pthread", "nixl_bare"),
                          ("agent_vs_aiohttp", "agent", "aiohttp")):
            if med(a, n) and med(b, n):
                per = [ra[n] / rb[n] for ra, rb in zip(per_round[a], per_round[b])]
                row[key] = statistics.median(per)
                row[key + "_per_round"] = per
        rows.append(row)

    cols = [c for c in names]
    head = f"{'size':>8} | " + " | ".join(f"{c:>21}" for c in cols) + " | nixl/bare | agent/aiohttp"
    print("\nREAD, one at a time (p50 latency, bandwidth at p50):\n" + head)
    for row in rows:
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{fmt_lat(v['p50_s']):>10} {v['gbps']:>6.2f} GB/s" if v else f"{'n/a':>21}")
        r1 = f"{row['nixl_vs_bare']:9.2f}" if "nixl_vs_bare" in row else f"{'-':>9}"
        r2 = f"{row['agent_vs_aiohttp']:13.2f}" if "agent_vs_aiohttp" in row else f"{'-':>13}"
        print(f"{fmt_size(row['bytes']):>8} | " + " | ".join(cells) + f" | {r1} | {r2}")
    print("\n(ratios: per round, median over rounds; targets: nixl/bare <= 1.2 at every size; "
          "agent/aiohttp <= 1.5 at 4 and 32 KiB)")
    extras: dict[str, Any] = {}
    for name in names:
        r = systems[name]
        if isinstance(r, str):
            print(f"{name}: not measured: {r}")
            continue
        t = r.get("target", {})
        e = {"cold_4k_p50_s": statistics.median(r["cold_4k"]) if r.get("cold_4k") else None,
             "target_idle_cpu_cores": t.get("idle_cpu_cores")}
        if "loop_lag_max_s" in t:
            e |= {"target_loop_lag_max_s": t["loop_lag_max_s"], "target_loop_lag_p99_s": t["loop_lag_p99_s"]}
        if "spin_done" in r:
            e["completed_in_spin"] = {fmt_size(k): v for k, v in r["spin_done"].items()}
        extras[name] = e
        lag = (f", target loop stalls max {fmt_lat(e['target_loop_lag_max_s'])} / p99 "
               f"{fmt_lat(e['target_loop_lag_p99_s'])}" if "target_loop_lag_max_s" in e else "")
        cold = fmt_lat(e["cold_4k_p50_s"]) if e["cold_4k_p50_s"] else "n/a"
        idle = f"{e['target_idle_cpu_cores']:.2f}" if e["target_idle_cpu_cores"] is not None else "n/a"
        print(f"{name:>13}: 4 KiB after {COLD_GAP_S * 1e3:.0f} ms idle p50 {cold}; "
              f"target idle CPU {idle} cores{lag}")
    auth = auth_cost_us() if "agent" in names else {}
    if auth:
        print(f"agent's HMAC per request: sign {auth['sign_us']:.1f} us + verify {auth['verify_us']:.1f} us")
    from tract_async.transport.nixl_env import nixl_version
    out = {"machine": {**_common.machine(), "nixl": nixl_version(), "load_before": load_before,
                       "load_after": os.getloadavg()},
           "args": vars(args), "sizes": sizes, "ucx_tls": "tcp,cuda_copy" if args.gpu else "tcp",
           "rows": rows, "extras": extras, "agent_auth_us": auth,
           "per_round_p50_s": {k: [{str(n): v for n, v in d.items()} for d in rs]
                               for k, rs in per_round.items()},
           "not_measured": {k: v for k, v in systems.items() if isinstance(v, str)},
           "raw_seconds": {k: {str(n): v["samples"][n] for n in sizes} | {"cold_4k": v.get("cold_4k")}
                           for k, v in systems.items() if isinstance(v, dict)}}
    res_dir = Path(__file__).resolve().parent / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    path = res_dir / f"transport-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}{'-gpu' if args.gpu else ''}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
