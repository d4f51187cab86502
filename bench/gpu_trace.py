"""Where a GPU transfer's time goes, from the device's own clock: the layer benchmark's
operations under ``torch.profiler`` (CUPTI), each copy's start and end on the GPU beside the
host's calls.

    python bench/gpu_trace.py                     # a GPU host; ~30 s
    python bench/gpu_trace.py --parts whole       # only the whole prompt

Why. ``bench/gpu_layers.py`` times each operation from the host (call to awaited result) and
splits it at the host's return and at the event's completion; it cannot say when the first
copy started on the device, how long the copies themselves ran, or whether the compute
kernels of a layer-pipelined prefill ran slower beside the copies. Issue 35's remaining gaps
need exactly that: the whole prompt's put is ~1.1 ms over the raw copy, of which the host's
start before its first copy is a guess; the 32-block pipelined prefill is 1-5 % over compute
alone, and whether the copies slow the kernels or the host's calls open gaps between them is
not known. The profiler's CUPTI activity records every copy and kernel of the context (those
the engine issues through its own ``ctypes`` handle to cudart included) with device times on
the host's clock, and ``record_function`` marks the host's calls on the same clock.

Parts (``--parts``):

* ``whole``: ``--reps`` whole-prompt puts (``put_kv`` of 213 Llama-3-8B blocks, 426 MiB) and
  reads (``start_get_kv`` + await), and raw pinned ``copy_`` of the same bytes each way. Per
  operation: host start to first copy (``pre``), first copy's start to last copy's end
  (``span``), the copies' summed duration (``busy``), last copy's end to the await's return
  (``tail``), the number of copies and the time inside each cudart call kind.
* ``layer1``: ``--rounds`` requests of one block, 32 layers put then read, each started and
  awaited: per operation the host's ``start_*`` call, its cudart calls, the copy, and the
  await's return after the copy ended.
* ``pipe32``: the pipelined prefill at 32 blocks and ~1 ms a layer (``gpu_layers.Compute``),
  ``--reps`` runs alone and with puts alternating: the compute kernels' summed time, their
  span, the gaps between them, and the copies that overlapped them.
* ``prefill``: the real thing the synthetic ``pipe32`` stands for, a random-weight Llama-3-8B
  (``serving.model``) prefilling ``--prefill-tokens`` prompts, ``--prefill-reps`` times each
  way: alone (``prefill``); layer-streamed with each layer's put started and not awaited
  (``prefill_streaming`` + ``start_put_kv``, as ``bench/gpu_pipeline.py``); and with each put
  awaited through the serving workers' ``KVDevice.put_layer``, as the prefill worker does.
  ``bench/gpu_pipeline.py`` measured 1.74x the prefill alone with puts at 1K tokens
  (``bench/results/gpu_pipeline.json``, cff1d7b) and 1.02-1.06x from 2K up, and a serving
  prefill worker ran a 512-token prompt in 60-125 ms where the same prompt's recompute took
  29-43 ms (``bench/results/gpu-20261206-s40``, call 2). Per run: the kernels' busy time, span
  and gaps, and the cudart calls of each host thread (the compute thread's launches, the
  loop's copies and events, the poller's event queries): whether the puts slow the kernels,
  open gaps between them, or slow the launches themselves.

The profiler adds ~1-2 µs to every cudart call and to every marked host call, so host times
here rank rather than time; device durations are the device's. Writes
``bench/results/gpu-trace-<UTC stamp>-<git sha>.json`` (summary, machine) and prints the
tables; ``--keep-trace`` also keeps the Chrome trace (large) beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import gpu_layers as G  # noqa: E402
from _common import RESULTS_DIR, commit, leave_path, llama_layout, machine  # noqa: E402
leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import tract_async as tract  # noqa: E402

PARTS = ("whole", "layer1", "pipe32", "prefill")


# -- the trace --------------------------------------------------------------------------------

class Trace:
    """The complete events of one exported Chrome trace, by category, times in µs."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            evs = json.load(f)["traceEvents"]
        self.marks: list[dict] = []
        self.copies: list[dict] = []
        self.kernels: list[dict] = []
        self.calls: list[dict] = []
        for e in evs:
            if e.get("ph") != "X":
                continue
            cat = e.get("cat", "")
            if cat == "user_annotation":
                self.marks.append(e)
            elif cat == "gpu_memcpy":
                self.copies.append(e)
            elif cat == "kernel":
                self.kernels.append(e)
            elif cat in ("cuda_runtime", "cuda_driver"):
                self.calls.append(e)
        for lst in (self.marks, self.copies, self.kernels, self.calls):
            lst.sort(key=lambda e: e["ts"])

    def marked(self, prefix: str) -> list[dict]:
        return [m for m in self.marks if m["name"].startswith(prefix)]

    @staticmethod
    def within(evs: list[dict], t0: float, t1: float) -> list[dict]:
        return [e for e in evs if t0 <= e["ts"] <= t1]


def end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0.0)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def medians(rows: list[dict], keys: tuple[str, ...]) -> dict[str, float | None]:
    """``<key>_med``: the median of each key over the rows that have it."""
    return {f"{k}_med": med([r[k] for r in rows if r.get(k) is not None]) for k in keys}


def call_times(calls: list[dict]) -> dict[str, dict[str, float]]:
    """cudart / driver time inside a window, by call name: count and summed µs."""
    out: dict[str, dict[str, float]] = {}
    for c in calls:
        d = out.setdefault(c["name"], {"n": 0, "us": 0.0})
        d["n"] += 1
        d["us"] += c.get("dur", 0.0)
    return out


def op_summary(tr: Trace, mark: dict) -> dict[str, Any]:
    """One awaited operation: its mark, the copies and calls inside it."""
    t0, t1 = mark["ts"], end(mark)
    cps = tr.within(tr.copies, t0, t1)
    row: dict[str, Any] = {"op": mark["name"], "total_us": t1 - t0, "copies": len(cps),
                           "calls": call_times(tr.within(tr.calls, t0, t1))}
    if cps:
        first, last = cps[0]["ts"], max(end(c) for c in cps)
        row.update(pre_us=first - t0, span_us=last - first,
                   busy_us=sum(c.get("dur", 0.0) for c in cps), tail_us=t1 - last,
                   gbs=sum(c.get("args", {}).get("bytes", 0) for c in cps)
                   / max(last - first, 1e-9) / 1e3)
    starts = [m for m in tr.within(tr.marks, t0, t1) if m["name"].startswith("start")]
    if starts:
        s = starts[0]
        row["start_us"] = s["dur"]
        row["start_calls"] = call_times(tr.within(tr.calls, s["ts"], end(s)))
        if cps:
            row["start_to_copy_us"] = cps[0]["ts"] - s["ts"]
    return row


def pipe_summary(tr: Trace, mark: dict) -> dict[str, Any]:
    """One pipelined run: the compute kernels' time, span and gaps; the copies beside them."""
    t0, t1 = mark["ts"], end(mark)
    ks = [k for k in tr.within(tr.kernels, t0, t1 + 50_000) if k["ts"] < t1]
    cps = tr.within(tr.copies, t0, t1 + 50_000)
    if not ks:
        return {"op": mark["name"], "kernels": 0}
    busy = sum(k.get("dur", 0.0) for k in ks)
    span = max(end(k) for k in ks) - ks[0]["ts"]
    gaps = [b["ts"] - end(a) for a, b in zip(ks, ks[1:])]
    overlap = 0.0
    for c in cps:
        c0, c1 = c["ts"], end(c)
        overlap += sum(max(0.0, min(c1, end(k)) - max(c0, k["ts"])) for k in ks
                       if k["ts"] < c1 and end(k) > c0)
    return {"op": mark["name"], "kernels": len(ks), "kernel_busy_ms": busy / 1e3,
            "kernel_span_ms": span / 1e3, "gap_sum_ms": sum(g for g in gaps if g > 0) / 1e3,
            "gap_max_us": max(gaps) if gaps else 0.0,
            "gaps_over_20us": sum(1 for g in gaps if g > 20.0),
            "copies": len(cps), "copy_busy_us": sum(c.get("dur", 0.0) for c in cps),
            "copy_kernel_overlap_us": overlap,
            "first_kernel_after_mark_us": ks[0]["ts"] - t0}


# -- the parts --------------------------------------------------------------------------------

async def part_whole(eng: Any, lay: Any, reps: int) -> None:
    n = 213
    kv = G.gen_kv(lay.kv_shape(n), seed=2000 + n, dev=G.Dev(True))
    out = torch.empty_like(kv)
    pinned = torch.empty(kv.numel() * 2, dtype=torch.uint8, pin_memory=True)
    flat = kv.view(torch.uint8).view(-1)
    tokens = list(range(n * lay.block_tokens))
    for r in range(reps + 1):
        keys = eng.block_keys(tokens, extra_keys=[f"trace-{os.getpid()}-{r}"])
        tag = "warm" if r == 0 else str(r)
        torch.cuda.synchronize()
        with record_function(f"whole_put_{tag}"):
            with record_function("start_put"):
                fut = await eng.start_put_kv(keys, kv)
            await fut
        torch.cuda.synchronize()
        with record_function(f"whole_get_{tag}"):
            with record_function("start_get"):
                fut = await eng.start_get_kv(keys, out=out)
            await fut
        if not G.same(out, kv):
            raise RuntimeError("whole prompt: the read differs from the put")
        await G.free_blocks(eng, keys, out)
        torch.cuda.synchronize()
        with record_function(f"raw_d2h_{tag}"):
            pinned.copy_(flat, non_blocking=True)
            torch.cuda.synchronize()
        with record_function(f"raw_h2d_{tag}"):
            flat.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()


async def part_layer1(eng: Any, lay: Any, rounds: int) -> None:
    kv = G.gen_kv(lay.kv_shape(1), seed=1001, dev=G.Dev(True))
    out = torch.empty_like(kv)
    tokens = list(range(lay.block_tokens))
    for r in range(rounds + 1):
        keys = eng.block_keys(tokens, extra_keys=[f"trace1-{os.getpid()}-{r}"])
        tag = "warm" if r == 0 else str(r)
        torch.cuda.synchronize()
        for i in range(lay.num_layers):
            with record_function(f"l1_put_{tag}_L{i}"):
                with record_function("start_put"):
                    fut = await eng.start_put_kv(keys, kv[i], layer=i)
                await fut
        for i in range(lay.num_layers):
            with record_function(f"l1_get_{tag}_L{i}"):
                with record_function("start_get"):
                    fut = await eng.start_get_kv(keys, out=out[i], layer=i)
                await fut
        if not G.same(out, kv):
            raise RuntimeError("one block: the read differs from the put")
        await G.free_blocks(eng, keys, out)


async def part_pipe32(eng: Any, lay: Any, reps: int, matmul: int) -> None:
    dev = G.Dev(True)
    comp = G.Compute(dev, matmul)
    comp.calibrate()
    count = comp.count_for(1.0)
    n = 32
    kv = G.gen_kv(lay.kv_shape(n), seed=3000 + n, dev=dev)
    out = torch.empty_like(kv)
    tokens = list(range(n * lay.block_tokens))
    for r in range(reps + 1):
        for wp in ((False, True) if r % 2 == 0 else (True, False)):
            keys = eng.block_keys(tokens, extra_keys=[f"tracep-{os.getpid()}-{r}"]) if wp else None
            tag = "warm" if r == 0 else str(r)
            with record_function(f"pipe_{'puts' if wp else 'alone'}_{tag}"):
                await G.compute_and_put(dev, eng, comp, count, kv, keys, lay.num_layers)
            if wp:
                await G.free_blocks(eng, keys, out)


def build_llama() -> Any:
    """A random-weight Llama-3-8B in bf16 on the GPU (``serving.model``; ~16 GB)."""
    from tract_async.serving.model import build_model, llama3_8b_config
    return build_model(llama3_8b_config(), seed=0, device="cuda", dtype=torch.bfloat16,
                       init_device="cuda")


async def part_prefill(eng: Any, lay: Any, model: Any, tokens: list[int], reps: int) -> None:
    from tract_async.serving.model import prefill
    from tract_async.serving.service import KVDevice
    from tract_async.serving.streaming import prefill_streaming
    cfg = model.config
    kvdev = KVDevice(eng)
    T = lay.block_tokens

    async def run(kind: str, ids: list[int], keys: list) -> None:
        n_full = len(ids) // T
        futs: list[Any] = []

        async def started(i: int, kv: Any, ready: Any = None) -> None:
            futs.append(await eng.start_put_kv(keys, kv[:, :n_full * T], layer=i, ready=ready))

        async def awaited(i: int, kv: Any, ready: Any = None) -> None:
            await kvdev.put_layer(keys, kv[:, :n_full * T], i, None, ready)

        if kind == "alone":
            prefill(model, ids)
        else:
            await prefill_streaming(model, ids, put_layer=started if kind == "started"
                                    else awaited)
            for f in futs:
                await f
        torch.cuda.synchronize()

    g = torch.Generator().manual_seed(11)
    for n in tokens:
        for r in range(reps + 1):
            tag = "warm" if r == 0 else str(r)
            for kind in ("alone", "started", "awaited"):
                ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                keys = eng.block_keys(ids)[:n // T]
                torch.cuda.synchronize()
                with record_function(f"prefill_{kind}_{n}_{tag}"):
                    await run(kind, ids, keys)
                if kind != "alone":
                    await G.free_blocks(eng, keys, torch.empty(lay.kv_shape(n // T),
                                                               dtype=lay.dtype, device="cuda"))


def prefill_summary(tr: Trace, mark: dict) -> dict[str, Any]:
    """One prefill: its kernels (busy, span, gaps) and each host thread's cudart calls."""
    t0, t1 = mark["ts"], end(mark)
    ks = tr.within(tr.kernels, t0, t1)
    row: dict[str, Any] = {"op": mark["name"], "wall_ms": (t1 - t0) / 1e3, "kernels": len(ks)}
    if ks:
        gaps = [b["ts"] - end(a) for a, b in zip(ks, ks[1:])]
        row.update(kernel_busy_ms=sum(k.get("dur", 0.0) for k in ks) / 1e3,
                   kernel_span_ms=(max(end(k) for k in ks) - ks[0]["ts"]) / 1e3,
                   gap_sum_ms=sum(g for g in gaps if g > 0) / 1e3,
                   gaps_over_20us=sum(1 for g in gaps if g > 20.0))
    threads: dict[str, dict[str, dict[str, float]]] = {}
    for c in tr.within(tr.calls, t0, t1):
        d = threads.setdefault(str(c.get("tid")), {}).setdefault(c["name"], {"n": 0, "us": 0.0})
        d["n"] += 1
        d["us"] += c.get("dur", 0.0)
    row["threads"] = threads
    launches = [d for t in threads.values() for name, d in t.items() if "LaunchKernel" in name]
    n_l = sum(d["n"] for d in launches)
    row["launches"] = n_l
    row["launch_us_mean"] = sum(d["us"] for d in launches) / n_l if n_l else None
    return row


# -- the run ----------------------------------------------------------------------------------

def summarize(tr: Trace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("whole_put", "whole_get", "raw_d2h", "raw_h2d"):
        rows = [op_summary(tr, m) for m in tr.marked(kind + "_") if "warm" not in m["name"]]
        if rows:
            out[kind] = {"rows": rows, **medians(rows, ("total_us", "pre_us", "span_us",
                                                         "busy_us", "tail_us", "start_us", "gbs",
                                                         "copies"))}
    for kind in ("l1_put", "l1_get"):
        rows = [op_summary(tr, m) for m in tr.marked(kind + "_")
                if "warm" not in m["name"] and not m["name"].endswith("_L0")]
        if rows:
            calls: dict[str, list[float]] = {}
            for r in rows:
                for name, d in r.get("start_calls", {}).items():
                    calls.setdefault(name, []).append(d["us"])
            out[kind] = {"n": len(rows), **medians(rows, ("total_us", "start_us",
                                                          "start_to_copy_us", "busy_us",
                                                          "tail_us")),
                         "start_calls_med_us": {k: med(v) for k, v in calls.items()}}
    for kind in ("alone", "started", "awaited"):
        rows = [prefill_summary(tr, m) for m in tr.marked(f"prefill_{kind}_")
                if "warm" not in m["name"]]
        by_n: dict[str, list[dict]] = {}
        for r in rows:
            by_n.setdefault(r["op"].split("_")[2], []).append(r)
        for n, rs in by_n.items():
            out[f"prefill_{kind}_{n}"] = {
                "rows": rs, **medians(rs, ("wall_ms", "kernel_busy_ms", "kernel_span_ms",
                                           "gap_sum_ms", "gaps_over_20us", "launches",
                                           "launch_us_mean"))}
    for kind in ("pipe_alone", "pipe_puts"):
        rows = [pipe_summary(tr, m) for m in tr.marked(kind + "_") if "warm" not in m["name"]]
        if rows:
            out[kind] = {"rows": rows, **medians(rows, ("kernel_busy_ms", "kernel_span_ms",
                                                         "gap_sum_ms", "gaps_over_20us",
                                                         "copy_kernel_overlap_us"))}
    return out


def show(summary: dict[str, Any]) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
    for kind in ("whole_put", "whole_get", "raw_d2h", "raw_h2d"):
        s = summary.get(kind)
        if s:
            print(f"{kind:>10}: total {f(s['total_us_med'])} us, start {f(s['start_us_med'])}, "
                  f"pre {f(s['pre_us_med'])}, span {f(s['span_us_med'])}, busy "
                  f"{f(s['busy_us_med'])}, tail {f(s['tail_us_med'])}, {f(s['copies_med'])} "
                  f"copies, {f(s['gbs_med'])} GB/s")
    for kind in ("l1_put", "l1_get"):
        s = summary.get(kind)
        if s:
            print(f"{kind:>10}: total {f(s['total_us_med'])} us, start {f(s['start_us_med'])} "
                  f"(cudart {', '.join(f'{k} {v:.1f}' for k, v in s['start_calls_med_us'].items())}"
                  f"), start->copy {f(s['start_to_copy_us_med'])}, copy {f(s['busy_us_med'])}, "
                  f"copy end->await {f(s['tail_us_med'])}")
    for kind in sorted(k for k in summary if k.startswith("prefill_")):
        s = summary[kind]
        print(f"{kind:>22}: wall {f(s['wall_ms_med'])} ms, kernels {f(s['kernel_busy_ms_med'])} "
              f"ms busy in {f(s['kernel_span_ms_med'])}, gaps {f(s['gap_sum_ms_med'])} ms "
              f"({f(s['gaps_over_20us_med'])} over 20 us), {f(s['launches_med'])} launches "
              f"at {f(s['launch_us_mean_med'])} us")
    for kind in ("pipe_alone", "pipe_puts"):
        s = summary.get(kind)
        if s:
            print(f"{kind:>10}: kernels {f(s['kernel_busy_ms_med'])} ms busy in "
                  f"{f(s['kernel_span_ms_med'])} ms, gaps {f(s['gap_sum_ms_med'])} ms "
                  f"({f(s['gaps_over_20us_med'])} over 20 us), copy/kernel overlap "
                  f"{f(s['copy_kernel_overlap_us_med'])} us")


async def amain(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("gpu_trace: no CUDA device", file=sys.stderr)
        return 2
    lay = llama_layout()
    path = f"/dev/shm/tract-gpu-trace-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=213 * lay.block_bytes + (1 << 30),
                             create=True, remove_on_close=True, layout=lay, mode="transfer",
                             namespace="bench-trace")
    tmp = tempfile.mkdtemp(prefix="gpu-trace-")
    trace_path = os.path.join(tmp, "trace.json")
    async with tract.Engine.open(cfg) as eng:
        eng.cuda_setup()
        # unprofiled warm-up of every part (kernels compiled, templates cached, clocks up)
        if "whole" in args.parts:
            await part_whole(eng, lay, 1)
        if "layer1" in args.parts:
            await part_layer1(eng, lay, 1)
        model = build_llama() if "prefill" in args.parts else None
        if model is not None:           # its kernels and the streaming path, unprofiled
            await part_prefill(eng, lay, model, [min(args.prefill_tokens)], 0)
        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=acts) as prof:
            if "whole" in args.parts:
                await part_whole(eng, lay, args.reps)
            if "layer1" in args.parts:
                await part_layer1(eng, lay, args.rounds)
            if "pipe32" in args.parts:
                await part_pipe32(eng, lay, args.reps, args.matmul)
            if "prefill" in args.parts:
                await part_prefill(eng, lay, model, args.prefill_tokens, args.prefill_reps)
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    summary = summarize(Trace(trace_path))
    show(summary)
    info = machine()
    info["gpu"] = torch.cuda.get_device_name(0)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    name = args.name or f"gpu-trace-{stamp}-{commit()}"
    out_dir = args.out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, name + ".json")
    if os.path.exists(out):
        raise SystemExit(f"{out} exists: results are never overwritten")
    with open(out, "w") as f:
        json.dump({"machine": info, "args": vars(args), "summary": summary}, f, indent=1)
    if args.keep_trace:
        os.replace(trace_path, os.path.join(out_dir, name + ".trace.json"))
    else:
        os.unlink(trace_path)
    os.rmdir(tmp)
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--reps", type=int, default=5, help="whole-prompt and pipelined reps")
    ap.add_argument("--rounds", type=int, default=2, help="one-block requests of 32 layers")
    ap.add_argument("--matmul", type=int, default=4096, help="the pipelined compute's size")
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--keep-trace", action="store_true")
    return tract.run(amain(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
