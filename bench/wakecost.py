"""What a wake-up costs on this host: the latency of waking a sleeping process, and how much slower
the code that runs next is than the same code back to back.

Why. On the 16-core H200 host (a Firecracker guest with no cpuidle driver: an idle vCPU halts into
the hypervisor) a 64 KiB handoff lost to NIXL shm by 3-4x although the engine's put and get, back
to back in one process, take ~20 µs each there. This bench shows where the rest goes, with its
baselines in the same run:

  host         clock source, cpuidle driver, halt-poll, transparent/huge pages, hypervisor flag.
  syscalls     ns per call: ``perf_counter_ns`` (the clock), ``getppid`` (a bare syscall),
               ``eventfd_write``, a datagram ``sendto`` to a missing socket (a doorbell ring
               to a node of another host), ``sched_yield``.
  pingpong     process A writes a stamp into a pipe, B stamps on receipt: B blocked in
               ``read`` (asleep) against B spinning on a non-blocking read; A pauses 0.3 or 3 ms
               between rounds so that B's vCPU has gone idle.
  after_wake   one operation timed right after its thread waited 300 µs: back to back (the
               baseline: no wait), spinning, ``time.sleep``, a blocking pipe read and the event
               loop's selector (``add_reader``) woken by another process. Operations: nothing,
               ~40 dict inserts of Python, ``np.copyto`` of 64 KiB, the engine's ``put_kv`` and
               ``get_kv`` of one 64 KiB block (hw backend, a region in ``--region-dir``).

Prints the tables and writes ``bench/results/wakecost-<time>-<commit>.json`` (every median and p90, the host).

Usage: python bench/wakecost.py [--reps 300] [--region-dir /dev/shm]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import sys
import time
from typing import Any, Awaitable, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402

import _common as C  # noqa: E402

GAP_S = 0.0003
"""How long each after-wake round waits before its operation (a vCPU idle this long halts)."""
WARM = 10


def host() -> dict[str, Any]:
    """What decides wake-up costs here (sysfs / procfs; '?' where absent)."""
    cpu = "/sys/devices/system/cpu"
    states = []
    d = f"{cpu}/cpu0/cpuidle"
    if os.path.isdir(d):
        for s in sorted(os.listdir(d)):
            states.append(f"{C.read_text(f'{d}/{s}/name')} ({C.read_text(f'{d}/{s}/latency')} us)")
    with open("/proc/cpuinfo") as f:
        flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    with open("/proc/meminfo") as f:
        huge = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in f
                if ln.startswith(("HugePages_Total", "HugePages_Free", "Hugepagesize"))}
    return {
        "clocksource": C.read_text("/sys/devices/system/clocksource/clocksource0/current_clocksource"),
        "cpuidle_driver": C.read_text(f"{cpu}/cpuidle/current_driver"),
        "cpuidle_states": states,
        "guest_halt_poll_ns": C.read_text("/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
        "thp": C.read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": C.read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "hugepages": huge,
        "hypervisor": "hypervisor" in flags,
        "cores": os.cpu_count(),
    }


def _per_call_ns(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def syscalls() -> dict[str, float]:
    """ns per call of what the engine's hot paths call."""
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setblocking(False)

    def ring() -> None:
        try:
            s.sendto(b"", "\0tract-wakecost-nobody")
        except OSError:
            pass
    try:
        return {"perf_counter_ns": _per_call_ns(time.perf_counter_ns, 20000),
                "getppid": _per_call_ns(os.getppid, 20000),
                "eventfd_write": _per_call_ns(lambda: os.eventfd_write(efd, 1), 20000),
                "sendto_missing": _per_call_ns(ring, 2000),
                "sched_yield": _per_call_ns(os.sched_yield, 2000)}
    finally:
        os.close(efd)
        s.close()


# -- pingpong -------------------------------------------------------------------------------------

def _echo(rfd: int, wfd: int, spin: bool) -> None:
    """B: on each 8-byte message, answer with the instant it was received."""
    if spin:
        os.set_blocking(rfd, False)
    while True:
        while True:
            try:
                b = os.read(rfd, 8)
                break
            except BlockingIOError:
                continue
        if len(b) < 8 or b == b"stopstop":
            return
        os.write(wfd, time.perf_counter_ns().to_bytes(8, "little"))


def pingpong(spin: bool, gap_s: float, reps: int) -> dict[str, float]:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    p = mp.get_context("fork").Process(target=_echo, args=(r1, w2, spin), daemon=True)
    p.start()
    lat = []
    try:
        for i in range(reps + WARM):
            time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            os.write(w1, b"pingping")
            t1 = int.from_bytes(os.read(r2, 8), "little")
            if i >= WARM:
                lat.append((t1 - t0) / 1e3)
        os.write(w1, b"stopstop")
        p.join(5)
    finally:
        if p.is_alive():
            p.kill()
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    return {"p50_us": C.median(lat), "p90_us": C.pct(lat, 90)}


# -- after a wake ---------------------------------------------------------------------------------

def _ticker(wfd: int, gap_s: float, n: int) -> None:
    """Another process: every ``gap_s`` (busy-timed, so the gap is exact) write one byte."""
    for _ in range(n):
        t = time.perf_counter() + gap_s
        while time.perf_counter() < t:
            pass
        os.write(wfd, b"t")


def _py_work() -> int:
    d = {}
    for i in range(40):
        d[i] = (i, str(i))
    return len(d)


WAITS = ("back_to_back", "spin", "sleep", "pipe_read", "selector")


async def after_wake(reps: int, region_dir: str) -> dict[str, dict[str, dict[str, float]]]:
    """{wait: {op: {p50_us, p90_us}}}: each op timed after each kind of 300 µs wait."""
    import torch

    from _putget.fixtures import BLOCK, REGION_OVERHEAD, det_keys, engine_cfg, make_kv

    import tract_async as tract
    path = os.path.join(region_dir, f"tract-wakecost-{os.getpid()}")
    out: dict[str, dict[str, dict[str, float]]] = {}
    region_bytes = (len(WAITS) * (reps + WARM) + 64) * BLOCK + REGION_OVERHEAD
    try:
        async with tract.Engine.open(engine_cfg(path, 0, region_bytes, True)) as eng:
            kv = make_kv(1)
            dst = torch.empty_like(kv)
            a = np.ones(64 * 1024, np.uint8)
            b = np.zeros_like(a)
            count = iter(range(1 << 62))
            present = det_keys("wakecost-get", 0, 1)
            await eng.put_kv(present, kv)

            async def put() -> None:
                await eng.put_kv(det_keys("wakecost-put", next(count), 1), kv)

            async def get() -> None:
                await eng.get_kv(present, out=dst)

            async def copy() -> None:
                np.copyto(b, a)

            async def py() -> None:
                _py_work()

            async def nothing() -> None:
                pass
            ops: dict[str, Callable[[], Awaitable[None]]] = {
                "nothing": nothing, "py_40_inserts": py, "np_copy_64KiB": copy,
                "put_kv_64KiB": put, "get_kv_64KiB": get}
            loop = asyncio.get_running_loop()
            rfd, wfd = os.pipe()
            try:
                for wait in WAITS:
                    out[wait] = {}
                    for name, op in ops.items():
                        tick = None
                        if wait in ("pipe_read", "selector"):
                            tick = mp.get_context("fork").Process(
                                target=_ticker, args=(wfd, GAP_S, reps + WARM), daemon=True)
                            tick.start()
                        ts = []
                        for i in range(reps + WARM):
                            if wait == "spin":
                                end = time.perf_counter() + GAP_S
                                while time.perf_counter() < end:
                                    pass
                            elif wait == "sleep":
                                time.sleep(GAP_S)
                            elif wait == "pipe_read":
                                os.read(rfd, 1)
                            elif wait == "selector":
                                fut = loop.create_future()
                                loop.add_reader(rfd, lambda f=fut: f.done() or f.set_result(None))
                                try:
                                    await fut
                                finally:
                                    loop.remove_reader(rfd)
                                os.read(rfd, 1)
                            t0 = time.perf_counter_ns()
                            await op()
                            t1 = time.perf_counter_ns()
                            if i >= WARM:
                                ts.append((t1 - t0) / 1e3)
                        if tick is not None:
                            tick.join(30)
                        out[wait][name] = {"p50_us": C.median(ts), "p90_us": C.pct(ts, 90)}
                    print(f"  after {wait}: done", flush=True)
            finally:
                os.close(rfd)
                os.close(wfd)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300, help="timed rounds per case (default 300)")
    ap.add_argument("--region-dir", default="/dev/shm", help="where the engine's region lives")
    args = ap.parse_args()
    h = host()
    print("host: " + ", ".join(f"{k} {v}" for k, v in h.items()), flush=True)
    sc = syscalls()
    print("\nns per call: " + ", ".join(f"{k} {v:.0f}" for k, v in sc.items()), flush=True)
    pp = []
    for spin in (False, True):
        for gap in (0.0003, 0.003):
            pp.append({"reader": "spins" if spin else "blocks in read", "gap_ms": gap * 1e3,
                       **pingpong(spin, gap, args.reps)})
    print("\ncross-process wake-up (pipe), µs\n" +
          C.table(pp, ["reader", "gap_ms", "p50_us", "p90_us"]), flush=True)
    print("\nan operation after a 300 µs wait ...", flush=True)
    aw = asyncio.run(after_wake(args.reps, args.region_dir))
    rows = []
    for op in aw["back_to_back"]:
        base = aw["back_to_back"][op]["p50_us"]
        row: dict[str, Any] = {"op": op}
        for wait in WAITS:
            row[f"{wait}_p50_us"] = aw[wait][op]["p50_us"]
        for wait in WAITS[1:]:
            row[f"{wait}/b2b"] = aw[wait][op]["p50_us"] / base if base > 0 else float("nan")
        rows.append(row)
    print("\nafter-wake p50 µs, and its ratio to back to back (same run)\n" +
          C.table(rows, ["op", *[f"{w}_p50_us" for w in WAITS], *[f"{w}/b2b" for w in WAITS[1:]]]),
          flush=True)
    path = C.write_json("wakecost", {"host": h, "syscalls_ns": sc, "pingpong": pp,
                                     "after_wake": aw, "region_dir": args.region_dir,
                                     "reps": args.reps})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
