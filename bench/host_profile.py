"""Where a layer operation's host time goes: a function profile of layer-streamed puts and gets.

    python bench/host_profile.py                       # a GPU host: start_put_kv / start_get_kv
    python bench/host_profile.py --device cpu          # the CPU path (put_kv / get_kv), any host

Issue 35 asks for <= 30 µs of host work per layer operation of any block count; the GPU layer
benchmark (``bench/gpu_layers.py``) measures 45-93 µs for one block on the H100 hosts
(``bench/results/gpu-20261206-s42``) and says how much is the ``start_*`` call and how much the
completion on the loop, not where inside them. This runs the same operation -- ``--blocks``
blocks of the Llama-3-8B geometry (64 KiB per block and layer), layer by layer, each layer's
put (then get) started and awaited -- first unprofiled (the per-operation time of this run,
median over layers 1-31 of ``--rounds`` rounds, no profiler overhead), then under cProfile for
the same rounds. Prints the median host time per operation, then the functions by own time
and by cumulative time (per operation: the profile's totals divided by the operations), and
writes ``bench/results/host-profile-<device>-<time>-<commit>.json`` with both and the pstats
text. The profiler's own overhead inflates every call, so the table ranks more than it times.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import _common as C  # noqa: E402
C.leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import torch  # noqa: E402

import tract_async as tract  # noqa: E402

NS_PER_US = 1000.0


class _Yard:
    def __init__(self) -> None:
        self.a = 1
        self.b: list[int] = []

    def f(self, x: int) -> int:
        return self.a + x


def yardstick_us() -> float:
    """A fixed piece of plain Python (calls, attributes, a list, a dict), timed: how fast this
    process runs Python right now. On the H100 hosts one tree's runs differ up to 2x
    (``bench/results/gpu-20261207-s51``); the operations' times over this tell the host's
    speed from the code's."""
    t0 = time.perf_counter_ns()
    r, t = _Yard(), 0
    for i in range(60):
        t += r.f(i)
        r.b.append(i)
        d = {"k": i}
        t += d["k"]
    return (time.perf_counter_ns() - t0) / NS_PER_US


async def one_round(eng: Any, cuda: bool, keys: list[bytes], kv: list[Any], out: list[Any],
                    times: dict[str, list[float]]) -> None:
    """Every layer's put, then every layer's get, each started and awaited; host times (the
    ``start_*`` call on the GPU, the whole call on the CPU) into ``times`` from layer 1 on."""
    pc = time.perf_counter_ns
    for i, t in enumerate(kv):
        t0 = pc()
        if cuda:
            fut = await eng.start_put_kv(keys, t, layer=i)
            t1 = pc()
            await fut
        else:
            await eng.put_kv(keys, t, layer=i)
            t1 = pc()
        if i:
            times["put"].append((t1 - t0) / NS_PER_US)
            times.setdefault("yardstick", []).append(yardstick_us())
    for i, o in enumerate(out):
        t0 = pc()
        if cuda:
            fut = await eng.start_get_kv(keys, out=o, layer=i)
            t1 = pc()
            await fut
        else:
            await eng.get_kv(keys, out=o, layer=i)
            t1 = pc()
        if i:
            times["get"].append((t1 - t0) / NS_PER_US)


_ROOT = os.path.dirname(_HERE)


def _short(fn: str) -> str:
    """A profiled function's file: relative to the repository, or from its package on."""
    if fn.startswith(_ROOT + os.sep):
        return os.path.relpath(fn, _ROOT)
    for mark in ("site-packages" + os.sep, "lib" + os.sep + "python"):
        if mark in fn:
            return fn.split(mark, 1)[1]
    return fn


def profile_rows(prof: cProfile.Profile, ops: int, key: str, top: int) -> list[dict[str, Any]]:
    st = pstats.Stats(prof)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{_short(fn)}:{line}({name})", "calls_per_op": nc / ops,
                     "tottime_us_per_op": tt * 1e6 / ops, "cumtime_us_per_op": ct * 1e6 / ops})
    rows.sort(key=lambda r: -r[key])
    return rows[:top]


def thread_times() -> dict[int, dict[str, Any]]:
    """Every thread of this process (Linux ``/proc``): name (Python's where it has one), CPU
    seconds, voluntary / involuntary context switches. A helper thread busy in a slow run shows
    here (the runs of one tree differ by 2x on the H100 hosts: ``gpu-20261207-s51``)."""
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, dict[str, Any]] = {}
    base = "/proc/self/task"
    if not os.path.isdir(base):
        return out
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/{tid}/comm") as f:
                comm = f.read().strip()
            sw = {}
            with open(f"{base}/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        k, v = line.split(":")
                        sw[k.strip()] = int(v)
        except OSError:
            continue                          # gone meanwhile
        out[int(tid)] = {"name": names.get(int(tid), comm),
                         "cpu_s": (int(fields[11]) + int(fields[12])) / tick,
                         "voluntary": sw.get("voluntary_ctxt_switches", 0),
                         "involuntary": sw.get("nonvoluntary_ctxt_switches", 0)}
    return out


def thread_delta(before: dict[int, dict[str, Any]],
                 after: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """What each thread did between two ``thread_times`` (threads born meanwhile count whole),
    busiest first."""
    rows = []
    for tid, a in after.items():
        b = before.get(tid, {"cpu_s": 0.0, "voluntary": 0, "involuntary": 0})
        rows.append({"tid": tid, "name": a["name"], "cpu_s": round(a["cpu_s"] - b["cpu_s"], 3),
                     "voluntary": a["voluntary"] - b["voluntary"],
                     "involuntary": a["involuntary"] - b["involuntary"]})
    rows.sort(key=lambda r: -r["cpu_s"])
    return rows


async def main_async(args: argparse.Namespace) -> int:
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    lay = C.llama_layout()
    dev = torch.device("cuda" if cuda else "cpu")
    region_dir = args.region_dir or "/dev/shm"
    path = tempfile.mktemp(prefix="tract-hostprof-", dir=region_dir)
    # three requests' worth of blocks by default: a round's blocks, the previous round's while
    # they are consumed, and room for the allocator's chunks (1 GiB held 504 of 1024 blocks)
    gib = args.region_gib or max(1, -(-3 * args.blocks * lay.block_bytes // (1 << 30)))
    cfg = tract.EngineConfig(region=path, region_bytes=(gib << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="host-profile",
                             mode=args.mode)
    res: dict[str, Any] = {"device": args.device, "blocks": args.blocks, "rounds": args.rounds,
                           "mode": args.mode, "layout": "llama3-8b 64 KiB/block/layer"}
    async with tract.Engine.open(cfg) as eng:
        if cuda:
            eng.cuda_setup()
            res["gpu"] = torch.cuda.get_device_name(0)
        shape = lay.kv_shape(args.blocks, 0)
        kv = [torch.randn(shape, device=dev).to(lay.dtype) for _ in range(lay.num_layers)]
        out = [torch.empty_like(t) for t in kv]
        whole = torch.empty(lay.kv_shape(args.blocks), dtype=lay.dtype, device=dev)
        n = 0
        last: list[list[bytes]] = []

        async def fresh() -> list[bytes]:
            """A new request's keys; in transfer mode the previous request's blocks are
            consumed first (one whole-block get, untimed) unless already gone, as a decode
            worker would."""
            nonlocal n
            n += 1
            if args.mode == "transfer" and last:
                prev = last.pop()
                if eng.lookup(prev) > 0:      # (a CPU layer-by-layer read consumed them)
                    await eng.get_kv(prev, out=whole)
            keys = eng.block_keys(range(n * 1_000_000, n * 1_000_000 + 16 * args.blocks))
            last.append(keys)
            return keys

        warm: dict[str, list[float]] = {"put": [], "get": []}
        for _ in range(args.warmup):
            await one_round(eng, cuda, await fresh(), kv, out, warm)
        plain: dict[str, list[float]] = {"put": [], "get": []}
        th0, w0 = thread_times(), time.perf_counter()
        for _ in range(args.rounds):
            await one_round(eng, cuda, await fresh(), kv, out, plain)
        res["threads_unprofiled"] = {"wall_s": round(time.perf_counter() - w0, 3),
                                     "threads": thread_delta(th0, thread_times())}
        prof = cProfile.Profile()
        profiled: dict[str, list[float]] = {"put": [], "get": []}
        for _ in range(args.rounds):
            keys = await fresh()
            prof.enable()
            await one_round(eng, cuda, keys, kv, out, profiled)
            prof.disable()
    ops = args.rounds * 2 * lay.num_layers
    res["host_us_median"] = {k: statistics.median(v) for k, v in plain.items()}
    yard = res["host_us_median"]["yardstick"]
    res["over_yardstick"] = {k: res["host_us_median"][k] / yard for k in ("put", "get")}
    res["host_us_median_profiled"] = {k: statistics.median(v) for k, v in profiled.items()}
    res["by_tottime"] = profile_rows(prof, ops, "tottime_us_per_op", args.top)
    res["by_cumtime"] = profile_rows(prof, ops, "cumtime_us_per_op", args.top)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(60)
    res["pstats_tottime"] = text.getvalue()
    print(f"host time per layer operation, median over layers 1-31 ({args.rounds} rounds, "
          f"{args.blocks} blocks, {args.device}, {args.mode} mode): put {res['host_us_median']['put']:.1f} us, "
          f"get {res['host_us_median']['get']:.1f} us (under the profiler: "
          f"{res['host_us_median_profiled']['put']:.1f} / "
          f"{res['host_us_median_profiled']['get']:.1f}); a Python yardstick {yard:.2f} us "
          f"in the same rounds: put / get {res['over_yardstick']['put']:.2f} / "
          f"{res['over_yardstick']['get']:.2f} of it")
    th = res["threads_unprofiled"]
    print(f"\nthreads during the unprofiled rounds ({th['wall_s']} s of wall time; CPU s, "
          f"voluntary / involuntary switches):")
    print(C.table(th["threads"], ["name", "tid", "cpu_s", "voluntary", "involuntary"]))
    for key, title in (("by_tottime", "own time"), ("by_cumtime", "cumulative time")):
        print(f"\nby {title}, per operation (puts and gets together, {ops} operations):")
        print(C.table([{"us": round(r[key.replace('by_', '') + '_us_per_op'], 2),
                        "calls": round(r["calls_per_op"], 2), "function": r["function"]}
                       for r in res[key]], ["us", "calls", "function"]))
    print("wrote", C.write_json(f"host-profile-{args.device}", res))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--blocks", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20, help="rounds of 32 puts and 32 gets")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--mode", choices=["transfer", "cache"], default="transfer",
                   help="the engine's mode (transfer: what the layer benchmark and a "
                        "prefill/decode pair run; cache: the default of runs before session 51)")
    p.add_argument("--region-dir", default=None)
    p.add_argument("--region-gib", type=int, default=None,
                   help="region size (GiB); default: three rounds' blocks, at least 1")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
