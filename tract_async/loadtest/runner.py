"""``tract bench serve``: the paper's evaluation, under load, against named baselines.

For each system it starts the serving stack (:class:`~tract_async.serving.launcher.Rack`: a
region where the system has one, a prefill worker, a decode worker, a router, on loopback), sends
a few warm-up requests, then runs every phase (workload x load) against the router's
``/v1/completions``, and stops the rack; one system after the other, or all racks up at once
with the phases interleaved across systems (:func:`run_all` says when each is the right
choice). A phase is one seeded request stream
(:mod:`.workloads`) sent in an open loop at a Poisson rate or in a closed loop of N clients
(:mod:`.generator`); its metrics are :mod:`.stats`'. Phase ``p`` gets the same prompts on
every system and shares no block with any other phase.

The systems, each named for what it is:

* ``http``: KV over the NIXL-style HTTP agent (aiohttp): the network stand-in, measured;
* ``nixl``: KV over NIXL between the workers' engines (``transport="nixl"``), UCX over TCP on
  loopback: the paper's baseline over the network stand-in, measured; ``nixl-local``: the same
  with UCX's own transports (shared memory, cuda copy), the same-host best case. Each row
  records the ``UCX_TLS`` it ran with; without the ``nixl`` package they are absent and say why;
* ``rdma-model``: a model: the measured prefill, then the KV's arrival held to 20 µs + bytes /
  25 GB/s (:mod:`tract_async.serving.rdma_model`);
* ``recompute``: no transfer: the decode worker computes the whole prompt;
* ``region-transfer``: KV through the shared region, transfer only, layer-streamed;
* ``region-cache``: KV through the shared region with the rack-wide prefix cache.

Before and after each phase it reads the workers' ``/health`` (engine counters: hits, bytes,
lock waits) and keeps the difference; with an NVML GPU it samples PCIe RX/TX all along. The
results go to ``results.json`` (machine, versions, seed, arguments, every phase's metrics) after
every phase, so a run cut short by ``--budget`` or Ctrl-C keeps what finished, and each request's
record to ``records.jsonl`` at the end; then ``summary.md`` and the plots (:mod:`.plots`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import glob
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from tract_async.loadtest.workloads import WORKLOADS

_GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class System:
    """One row of the comparison: the rack mode that serves it (None: not servable here)."""
    name: str
    mode: str | None
    what: str
    ucx_tls: str | None = None
    """nixl rows: the workers' ``UCX_TLS`` on the CPU."""
    ucx_tls_cuda: str = "cuda_copy"
    """nixl rows on a CUDA device: transports added to ``ucx_tls`` (NIXL's UCX backend refuses
    GPU memory without ``cuda_copy``; ``cuda_ipc`` maps a peer's GPU memory on the same host)."""


SYSTEMS: tuple[System, ...] = (
    System(name="http", mode="http",
           what="KV over the NIXL-style HTTP agent (aiohttp): the network stand-in, measured"),
    System(name="nixl", mode="nixl", ucx_tls="tcp",
           what="KV over NIXL, UCX over TCP on loopback: the paper's baseline over the network "
                "stand-in, measured"),
    System(name="nixl-local", mode="nixl", ucx_tls="shm,tcp", ucx_tls_cuda="cuda_copy,cuda_ipc",
           what="KV over NIXL, UCX over shared memory (GPU to GPU by cuda_ipc on a GPU host): "
                "the same-host best case, measured"),
    System(name="rdma-model", mode="rdma-model",
           what="MODEL, not a measurement: measured prefill, then KV held to 20 us + bytes at "
                "25 GB/s (serving/rdma_model.py)"),
    System(name="recompute", mode="recompute",
           what="no transfer: the decode worker computes the whole prompt itself"),
    System(name="region-transfer", mode="region-transfer",
           what="KV through the shared region, transfer only, layer-streamed"),
    System(name="region-cache", mode="region-cache",
           what="KV through the shared region with the rack-wide prefix cache"),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)

#: Sizes: ``smoke`` is the CI run (tiny model, CPU, a few seconds of load per system), ``cpu``
#: the README's run on a 2-core VM (about three minutes), ``h200`` the paper's acceptance point
#: with Llama-3-8B geometry on one GPU: chat and RAG, a closed loop that measures each system's
#: peak, then an open loop at 0.75x of http's peak (where the paper compares), meant to fit one
#: 10-minute call (not yet run in this form); ``h200-full`` every workload and three load
#: points (several calls' worth).
PRESETS: dict[str, dict[str, Any]] = {
    "smoke": dict(model="tiny", device="cpu", dtype=None, workloads="chat", requests=8,
                  input_len="512:4096", length_scale=1 / 16, output_len=4, rates="8",
                  concurrency="", sweep="all", group_size=4, region_bytes=64 << 20,
                  kv_pool_bytes=32 << 20,
                  ttft_slo_ms=500.0, warmup=1, start_timeout=120.0, request_timeout=60.0,
                  budget=240.0, interleave=False),
    "cpu": dict(model="tiny", device="cpu", dtype=None, workloads=",".join(WORKLOADS),
                requests=16, input_len="512:8192", length_scale=1 / 16, output_len=16,
                rates="4,8,16", concurrency="4", sweep="chat", group_size=4,
                region_bytes=256 << 20,
                kv_pool_bytes=64 << 20, ttft_slo_ms=250.0, warmup=2, start_timeout=120.0,
                request_timeout=120.0, budget=1800.0, interleave=False),
    "h200": dict(model="llama3-8b", device="cuda", dtype="bfloat16",
                 workloads="chat,rag", requests=12, input_len="512:8192",
                 length_scale=1.0, output_len=32, rates="0.75x", concurrency="4",
                 sweep="chat,rag", group_size=4, region_bytes=32 * _GIB, kv_pool_bytes=8 * _GIB,
                 ttft_slo_ms=2000.0, warmup=2, start_timeout=300.0, request_timeout=300.0,
                 budget=570.0, interleave=False),
    # the former h200 axes (every workload, rates 1-3 req/s): ~400 s for http alone on one
    # H200, whose peak was below 1 req/s there, so those rates only measured queues
    "h200-full": dict(model="llama3-8b", device="cuda", dtype="bfloat16",
                      workloads=",".join(WORKLOADS), requests=16, input_len="512:8192",
                      length_scale=1.0, output_len=64, rates="0.5x,0.75x,0.9x",
                      concurrency="8", sweep="chat", group_size=4, region_bytes=32 * _GIB,
                      kv_pool_bytes=8 * _GIB, ttft_slo_ms=2000.0, warmup=2,
                      start_timeout=300.0, request_timeout=600.0, budget=1800.0,
                      interleave=False),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tract bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=sorted(PRESETS), default="smoke",
                   help="preset for every option left unset")
    p.add_argument("--systems", default=",".join(SYSTEM_NAMES),
                   help="comma-separated, run in this order (a --budget that runs out cancels "
                        "the last)")
    p.add_argument("--workloads", default=None, help=f"comma-separated subset of {WORKLOADS}")
    p.add_argument("--requests", type=int, default=None, help="requests per phase")
    p.add_argument("--input-len", default=None, help="MIN:MAX prompt tokens before scaling")
    p.add_argument("--length-scale", type=float, default=None,
                   help="multiplies MIN:MAX (1/16 for the tiny CPU model)")
    p.add_argument("--output-len", type=int, default=None, help="max_tokens per request")
    p.add_argument("--group-size", type=int, default=None,
                   help="turns per chat, questions per RAG document")
    p.add_argument("--rates", default=None,
                   help="open-loop Poisson rates (req/s, 'inf' = all at once), comma-separated; "
                        "'0.75x' is 0.75 times the peak throughput that --rate-reference "
                        "measured in its closed loop of the same workload (needs --concurrency)")
    p.add_argument("--rate-reference", default="http",
                   help="the system whose closed-loop peak the relative rates ('0.75x') scale")
    p.add_argument("--concurrency", default=None, help="closed-loop client counts, comma-separated")
    p.add_argument("--sweep", default=None,
                   help="workloads that get every rate and client count (the others: the first "
                        "load only); 'all' for every workload")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="goodput's TTFT objective")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and arrivals")
    p.add_argument("--warmup", type=int, default=None, help="uncounted requests per system")
    p.add_argument("--model", choices=("tiny", "llama3-8b"), default=None)
    p.add_argument("--device", default=None, help="cpu or cuda[:i]")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=1, help="per worker (CPU)")
    p.add_argument("--region-bytes", type=int, default=None,
                   help="shared region (capped at half of /dev/shm's free space)")
    p.add_argument("--kv-pool-bytes", type=int, default=None, help="http: the prefill's KV pool")
    p.add_argument("--rdma-gbps", type=float, default=25.0, help="rdma-model bandwidth")
    p.add_argument("--rdma-latency-us", type=float, default=20.0, help="rdma-model per transfer")
    p.add_argument("--service-opt", action="append", default=[], metavar="[ROLE:]FIELD=VALUE",
                   help="a ServiceConfig field for every service of every rack, or for one role "
                        "(e.g. decode:early_reads=1, wait_spin_us=0); repeatable, recorded in "
                        "results.json")
    p.add_argument("--start-timeout", type=float, default=None, help="seconds per service start")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--out-dir", default="tract-bench-out",
                   help="results.json, records.jsonl, summary.md, plots, service logs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--resummarize", metavar="DIR", default=None,
                   help="run nothing: recompute a finished run's metrics from its records.jsonl "
                        "and rewrite its results.json, summary.md and plots")
    p.add_argument("--merge", metavar="DIR", nargs="+", default=None,
                   help="run nothing: merge finished runs (parts of one evaluation: the same "
                        "workload options, each system in one part) into --out-dir and "
                        "recompute its results.json, summary.md and plots")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="start every rack first, then run each phase on every system before "
                        "the next phase (robust to a shared host's changing load, for hosts "
                        "with cores to spare; off at every size)")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, fill unset options from the preset, validate. Raises SystemExit (argparse) on
    bad input, with a message that says what to change."""
    p = build_parser()
    args = p.parse_args(argv)
    for key, value in PRESETS[args.size].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.system_list = _split(args.systems)
    args.workload_list = _split(args.workloads)
    args.sweep_list = args.workload_list if args.sweep == "all" else _split(args.sweep)
    try:
        rates = _split(args.rates)
        args.rate_list = [float(x) for x in rates if not x.endswith("x")]
        args.rel_rate_list = [float(x[:-1]) for x in rates if x.endswith("x")]
        args.concurrency_list = [int(x) for x in _split(args.concurrency)]
        lo, hi = (int(x) for x in args.input_len.split(":"))
    except ValueError as exc:
        p.error(f"--rates, --concurrency or --input-len: {exc}")
    args.min_input_tokens = max(8, round(lo * args.length_scale))
    args.max_input_tokens = max(args.min_input_tokens, round(hi * args.length_scale))
    bad = ([s for s in args.system_list if s not in SYSTEM_NAMES]
           + [w for w in args.workload_list + args.sweep_list if w not in WORKLOADS])
    if bad:
        p.error(f"unknown system(s) or workload(s) {bad}; systems: {', '.join(SYSTEM_NAMES)}; "
                f"workloads: {', '.join(WORKLOADS)}")
    if not args.rate_list and not args.rel_rate_list and not args.concurrency_list:
        p.error("give at least one --rates or --concurrency value")
    try:
        service_options(args.service_opt)
    except ValueError as exc:
        p.error(str(exc))
    if (any(not r > 0 for r in args.rate_list + args.rel_rate_list)
            or any(c < 1 for c in args.concurrency_list)):
        p.error("rates must be > 0 and concurrency >= 1")
    if args.rel_rate_list and not args.concurrency_list:
        p.error("relative rates ('0.75x') scale a closed-loop peak: give --concurrency too")
    if args.rel_rate_list and args.rate_reference not in args.system_list:
        p.error(f"--rate-reference {args.rate_reference} is not among --systems "
                f"({', '.join(args.system_list)})")
    args.peaks = {}          # workload -> the reference's closed-loop peak (req/s), when measured
    return args


async def within_budget(work: Callable[[], Awaitable[None]], budget_s: float,
                        report: dict[str, Any]) -> None:
    """Run ``work()`` until it ends, ``budget_s`` is spent, or SIGINT / SIGTERM arrives; the
    report's ``status`` says which (``ok``, ``budget of N s exhausted``, ``interrupted``), so
    that a cut-off run still writes what it measured. Any other error propagates."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        async with asyncio.timeout(budget_s):
            await work()
        report["status"] = "ok"
    except TimeoutError:
        report["status"] = f"budget of {budget_s} s exhausted"
    except asyncio.CancelledError:
        report["status"] = "interrupted"
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _split(text: str) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def loads(args: argparse.Namespace, kind: str) -> list[tuple[str, float]]:
    """The loads of workload ``kind``: ``("open", rate)`` for every rate, then ``("closed",
    clients)`` for every client count; a workload outside ``--sweep`` gets only the first.

    With relative rates (``"0.75x"``), the closed loops come first (they measure the peak the
    rates scale) and ``("open-rel", fraction)`` follow the absolute rates; a workload outside
    ``--sweep`` then gets the first closed loop and the first relative rate."""
    rel = getattr(args, "rel_rate_list", [])
    if not rel:
        every = ([("open", r) for r in args.rate_list]
                 + [("closed", float(c)) for c in args.concurrency_list])
        return every if kind in args.sweep_list else every[:1]
    closed = [("closed", float(c)) for c in args.concurrency_list]
    opened = [("open", r) for r in args.rate_list] + [("open-rel", f) for f in rel]
    if kind in args.sweep_list:
        return closed + opened
    return closed[:1] + [("open-rel", rel[0])]


def resolve_rate(args: argparse.Namespace, kind: str, fraction: float) -> tuple[float, str]:
    """The rate of a relative load: ``fraction`` of the reference system's closed-loop peak of
    workload ``kind``, and where that peak came from. Raises LookupError when the reference
    measured none (it failed, or ran after this phase)."""
    peak = args.peaks.get(kind)
    if peak is None or not peak > 0:
        raise LookupError(f"no closed-loop peak of {kind} from {args.rate_reference} to scale "
                          f"({fraction:g}x); it failed or has not run")
    return fraction * peak, f"{fraction:g}x {args.rate_reference} peak {peak:.3g} req/s"


def load_label(loop: str, value: float) -> str:
    if loop == "open":
        return "all at once" if math.isinf(value) else f"{value:g} req/s"
    if loop == "open-rel":
        return f"{value:g}x peak"
    return f"{int(value)} clients"


def nixl_absent_reason() -> str | None:
    """Why the ``nixl`` rows cannot run here (None: they can)."""
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the reason goes into the report
        return (f"nixl not importable ({type(exc).__name__}: {exc}): "
                f"pip install nixl nixl-cu12 --no-deps")
    return None


def absent_reason(system: System) -> str | None:
    """Why ``system`` has no rack here (None: it has one)."""
    if system.mode is None:
        return "not servable by this harness"
    if system.mode == "nixl":
        return nixl_absent_reason()
    return None


def ucx_env(system: System, device: str) -> dict[str, str]:
    """The workers' UCX settings for a nixl row (``System.ucx_tls``)."""
    if not system.ucx_tls:
        return {}
    tls = system.ucx_tls
    if device.startswith("cuda"):
        tls += "," + system.ucx_tls_cuda
    return {"UCX_TLS": tls}


def region_bytes_for(want: int, shm: str = "/dev/shm") -> int:
    """``want`` capped at half the free space of ``shm``, in whole 2 MiB chunks."""
    try:
        import shutil
        free = shutil.disk_usage(shm).free
    except OSError:
        free = 2 * want
    return max(2 << 20, min(want, free // 2) // (2 << 20) * (2 << 20))


# --- one system ---------------------------------------------------------------------------------
async def _health(session: Any, url: str) -> dict[str, Any]:
    import aiohttp
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _engine_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counter differences of a worker's ``engine`` health block over one phase."""
    b, a = before.get("engine") or {}, after.get("engine") or {}
    return {k: a[k] - b.get(k, 0) for k in a
            if isinstance(a[k], (int, float)) and isinstance(b.get(k, 0), (int, float))}


def _spec(args: argparse.Namespace, kind: str, phase: int, requests: int) -> Any:
    from tract_async.loadtest.workloads import Vocab, WorkloadSpec
    return WorkloadSpec(kind=kind, requests=requests, seed=args.seed, phase=phase,
                        min_input_tokens=args.min_input_tokens,
                        max_input_tokens=args.max_input_tokens, output_tokens=args.output_len,
                        group_size=args.group_size, vocab=Vocab.for_model(args.model))


#: Phase numbers are 1.. in run order; the warm-up's stream has its own.
WARMUP_PHASE = 10_000


def service_options(items: list[str]) -> dict[str, Any]:
    """``--service-opt`` values as Rack options: ``{field: value}`` for every service and
    ``role_options`` for ``role:field=value``, each value parsed as the ServiceConfig field's
    type. Raises ValueError naming a bad item."""
    import dataclasses as dc
    from tract_async.serving.service import ServiceConfig
    fields = {f.name: f for f in dc.fields(ServiceConfig)}
    common: dict[str, Any] = {}
    roles: dict[str, dict[str, Any]] = {}
    for item in items:
        target, eq, value = item.partition("=")
        role, _, name = target.rpartition(":")
        f = fields.get(name)
        if not eq or f is None or name in ("role", "mode", "region", "prefill_url", "decode_url") \
                or role not in ("", "prefill", "decode", "router"):
            raise ValueError(f"--service-opt {item!r}: expected [ROLE:]FIELD=VALUE with a "
                             f"ServiceConfig field")
        kind = type(f.default) if f.default is not None else str
        try:
            v: Any = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
        except ValueError as e:
            raise ValueError(f"--service-opt {item!r}: {e}") from None
        (roles.setdefault(role, {}) if role else common)[name] = v
    return {**common, **({"role_options": roles} if roles else {})}


def make_rack(system: System, args: argparse.Namespace) -> Any:
    """The (not yet started) rack that serves ``system``."""
    from tract_async.serving.launcher import Rack
    assert system.mode is not None, f"runner: {system.name} has no rack mode"
    return Rack(mode=system.mode, region=f"/dev/shm/tract-bench-{os.getpid()}-{system.name}",
                log_dir=os.path.join(args.out_dir, "logs"), start_timeout_s=args.start_timeout,
                env=ucx_env(system, args.device),
                seed=args.seed, model=args.model, device=args.device, dtype=args.dtype,
                block_tokens=args.block_tokens,
                torch_threads=args.torch_threads if args.device == "cpu" else None,
                region_bytes=region_bytes_for(args.region_bytes),
                kv_pool_bytes=args.kv_pool_bytes, request_timeout_s=args.request_timeout,
                layer_timeout_s=min(120.0, args.request_timeout),
                rdma_gbps=args.rdma_gbps, rdma_latency_us=args.rdma_latency_us,
                **service_options(args.service_opt))


async def start_rack(system: System, rack: Any, entry: dict[str, Any]) -> None:
    """Start ``rack``, recording how long it took. Raises ServiceStartFailed."""
    t0 = time.perf_counter()
    print(f"[{system.name}] starting region, prefill, decode, router ...", file=sys.stderr,
          flush=True)
    await rack.start()
    entry["start_s"] = round(time.perf_counter() - t0, 2)
    print(f"[{system.name}] up in {entry['start_s']} s", file=sys.stderr, flush=True)


async def stop_rack(rack: Any, entry: dict[str, Any]) -> None:
    """Stop ``rack`` (idempotent), keeping what the stop reports and how long it took."""
    t0 = time.perf_counter()
    entry["stop_problems"] = await asyncio.shield(rack.stop())
    entry["stop_s"] = round(time.perf_counter() - t0, 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """One phase of the plan: its number (1.., the prompts' salt), workload and load."""
    phase: int
    kind: str
    loop: str
    value: float

    @property
    def label(self) -> str:
        return load_label(self.loop, self.value)


def phase_plan(args: argparse.Namespace) -> list[Step]:
    """Every phase, in the order each system runs them (the same for every system)."""
    steps: list[Step] = []
    for kind in args.workload_list:
        for loop, value in loads(args, kind):
            steps.append(Step(phase=len(steps) + 1, kind=kind, loop=loop, value=value))
    return steps


async def warm_system(rack: Any, args: argparse.Namespace, entry: dict[str, Any]) -> None:
    """A few requests that are not counted (first-request costs: connections, allocations)."""
    from tract_async.loadtest.generator import run_closed_loop
    from tract_async.loadtest.workloads import build_requests
    if args.warmup:
        warm = build_requests(_spec(args, args.workload_list[0], WARMUP_PHASE, args.warmup))
        recs = await run_closed_loop(rack.router_url, warm, 1, timeout_s=args.request_timeout)
        entry["warmup_errors"] = [r.error for r in recs if r.error]


async def run_phase(system: System, rack: Any, step: Step, args: argparse.Namespace,
                    entry: dict[str, Any], sampler: Any, write: Callable[[], None]) -> None:
    """One phase against the started ``rack``: its records, metrics and engine counters go to
    ``entry['phases']``, and the results file is rewritten."""
    import aiohttp

    from tract_async.loadtest.generator import (Progress, arrival_times, run_closed_loop,
                                             run_open_loop)
    from tract_async.loadtest.stats import summarize
    from tract_async.loadtest.workloads import build_requests, ideal_hit_rate
    workers = {role: rack.url_of(role) for role in ("prefill", "decode")}
    reqs = build_requests(_spec(args, step.kind, step.phase, args.requests))
    loop, value, label, scaled = step.loop, step.value, step.label, None
    if loop == "open-rel":        # a fraction of the reference's peak, measured before
        value, scaled = resolve_rate(args, step.kind, step.value)
        loop, label = "open", f"{value:.3g} req/s ({scaled})"
    async with aiohttp.ClientSession() as session:
        before = {r: await _health(session, u) for r, u in workers.items()}
        sampler.mark(f"{system.name} {step.kind} {label}")
        progress = Progress(f"[{system.name}] {step.kind} @ {label}", len(reqs))
        t0 = time.perf_counter()
        try:
            if loop == "open":
                at = arrival_times(len(reqs), value, seed=args.seed * 1000 + step.phase,
                                   burstiness=args.burstiness)
                recs = await run_open_loop(rack.router_url, reqs, list(at),
                                           timeout_s=args.request_timeout, progress=progress)
            else:
                recs = await run_closed_loop(rack.router_url, reqs, int(step.value),
                                             timeout_s=args.request_timeout, progress=progress)
        finally:
            progress.close()
        wall = time.perf_counter() - t0
        after = {r: await _health(session, u) for r, u in workers.items()}
    summary = summarize(recs, ttft_slo_ms=args.ttft_slo_ms)
    summary["ideal_hit_rate"] = ideal_hit_rate(reqs, args.block_tokens)
    summary["wall_s"] = wall
    if step.loop == "closed" and system.name == args.rate_reference:
        # the peak the relative rates scale: the best of its closed loops (they run first)
        args.peaks[step.kind] = max(args.peaks.get(step.kind, 0.0),
                                    summary.get("throughput_rps") or 0.0)
    entry["phases"].append({
        "phase": step.phase, "workload": step.kind, "loop": loop, "value": value,
        "label": label, "summary": summary, "scaled_from": scaled,
        "engine": {r: _engine_delta(before[r], after[r]) for r in workers},
        "records": [r.to_json() for r in recs]})
    write()


def _remove_leftover_regions() -> None:
    for path in glob.glob(f"/dev/shm/tract-bench-{os.getpid()}-*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _failed(system: System, entry: dict[str, Any], exc: Exception) -> None:
    entry.update(status="error", reason=f"{type(exc).__name__}: {exc}",
                 traceback=traceback.format_exc())
    print(f"[{system.name}] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


async def run_all(args: argparse.Namespace, report: dict[str, Any],
                  write: Callable[[], None]) -> None:
    """Every requested system over the same phases; a system that fails is recorded and the
    run goes on without it.

    Two schedules. In turn (the default): one rack at a time, all its phases, then the next
    (a finished rack stops while the next one starts; the next phases begin once the stop is
    over, so no phase shares the host with another rack). Interleaved (``--interleave``): every
    rack is started first, then each phase runs on every system before the next phase (the
    order rotating from phase to phase), so that a change in the host's other load (a shared
    VM) falls on every system alike instead of on whichever ran at the time; the idle racks'
    heartbeats, lock managers and pollers take CPU throughout, the same for all. That is for
    hosts with cores to spare: on the 2-core VM, four idle racks next to the measured one made
    the cpu size's run take 196 CPU-s instead of 140 (39 s of it in the kernel) and every TTFT
    several times longer, so the cpu size runs the systems in turn.
    """
    from tract_async.cuda.telemetry import NvmlSampler
    sampler = NvmlSampler(interval_s=0.1)
    report["telemetry"] = {"available": sampler.available, "reason": sampler.reason or None}
    # in the order asked for: a budget that runs out cancels the last ones (the H100 run of
    # 2026-12-06 lost region-transfer, listed first, behind two slow nixl rows of the canonical
    # order: bench/results/gpu-20261206-s40, call 1)
    by_name = {s.name: s for s in SYSTEMS}
    chosen = [by_name[name] for name in dict.fromkeys(args.system_list)]
    entries: dict[str, dict[str, Any]] = {}
    for system in chosen:
        entries[system.name] = report["systems"][system.name] = {
            "what": system.what, "mode": system.mode, "phases": [], "status": "pending"}
        if system.ucx_tls is not None:      # the UCX transports the row ran over
            entries[system.name]["ucx_tls"] = (ucx_env(system, args.device).get("UCX_TLS")
                                               or os.environ.get("UCX_TLS") or "UCX default")
        why = absent_reason(system)
        if why is not None:
            entries[system.name].update(status="absent", reason=why)
            print(f"[{system.name}] absent: {why}", file=sys.stderr, flush=True)
    write()
    racks = {s.name: make_rack(s, args) for s in chosen if absent_reason(s) is None}
    servable = [s for s in chosen if s.name in racks]
    if getattr(args, "rel_rate_list", None):   # the reference measures the peak first
        servable.sort(key=lambda s: s.name != args.rate_reference)
    plan = phase_plan(args)
    try:
        async with asyncio.TaskGroup() as tg:
            sampling = tg.create_task(sampler.run())
            try:
                if args.interleave:
                    await _run_interleaved(servable, racks, plan, args, entries, sampler, write)
                else:
                    await _run_in_turn(servable, racks, plan, args, entries, sampler, write, tg)
            except asyncio.CancelledError:
                for e in entries.values():
                    if e["status"] in ("pending", "running"):
                        e["status"] = "cancelled (budget or signal)"
                raise
            finally:
                sampling.cancel()
                report["telemetry"].update(sampler.summary(), series=sampler.series(),
                                           marks=sampler.marks)
    finally:
        for name, rack in racks.items():   # idempotent: those already stopped return at once
            if "stop_s" not in entries[name]:
                await stop_rack(rack, entries[name])
        write()


async def _run_in_turn(servable: list[System], racks: dict[str, Any], plan: list[Step],
                       args: argparse.Namespace, entries: dict[str, dict[str, Any]],
                       sampler: Any, write: Callable[[], None], tg: asyncio.TaskGroup) -> None:
    stops: list[asyncio.Task[None]] = []
    for system in servable:
        rack, entry = racks[system.name], entries[system.name]
        entry["status"] = "running"
        try:
            await start_rack(system, rack, entry)   # while the previous rack stops
            if stops:
                await asyncio.wait(stops)
            await warm_system(rack, args, entry)
            for step in plan:
                await run_phase(system, rack, step, args, entry, sampler, write)
            entry["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded; the next system still runs
            _failed(system, entry, exc)
        finally:
            write()
        stops.append(tg.create_task(stop_rack(rack, entry)))
    if stops:
        await asyncio.wait(stops)


async def _run_interleaved(servable: list[System], racks: dict[str, Any], plan: list[Step],
                           args: argparse.Namespace, entries: dict[str, dict[str, Any]],
                           sampler: Any, write: Callable[[], None]) -> None:
    outcomes = await asyncio.gather(*(start_rack(s, racks[s.name], entries[s.name])
                                      for s in servable), return_exceptions=True)
    live: list[System] = []
    for system, outcome in zip(servable, outcomes):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome
            _failed(system, entries[system.name], outcome)
        else:
            entries[system.name]["status"] = "running"
            live.append(system)
    for system in list(live):
        try:
            await warm_system(racks[system.name], args, entries[system.name])
        except Exception as exc:  # noqa: BLE001 - recorded; the others still run
            _failed(system, entries[system.name], exc)
            live.remove(system)
    for i, step in enumerate(plan):
        k = i % len(live) if live else 0
        for system in live[k:] + live[:k]:
            try:
                await run_phase(system, racks[system.name], step, args, entries[system.name],
                                sampler, write)
            except Exception as exc:  # noqa: BLE001 - recorded; the others still run
                _failed(system, entries[system.name], exc)
                live.remove(system)
                await stop_rack(racks[system.name], entries[system.name])
    for system in live:
        entries[system.name]["status"] = "ok"
    await asyncio.gather(*(stop_rack(racks[s.name], entries[s.name]) for s in live))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0 when every servable system ran every phase."""
    args = resolve_args(argv)
    from tract_async.loadtest.report import (machine_info, print_summary_table, resummarize,
                                                write_records, write_report, write_results)
    if args.resummarize:
        report = resummarize(args.resummarize)
        print(print_summary_table(report))
        print(f"recomputed {args.resummarize} from its records")
        return 0
    if args.merge:
        from tract_async.loadtest.merge import MergeError, merge_runs
        try:
            report = merge_runs(args.merge, args.out_dir)
        except MergeError as exc:
            print(f"tract bench serve --merge: {exc}", file=sys.stderr)
            return 2
        print(print_summary_table(report))
        print(f"merged {len(args.merge)} runs into {args.out_dir}")
        return 0
    import tract_async as tract
    args.out_dir = os.path.abspath(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    report: dict[str, Any] = {
        "bench": "serve_load", "status": "running", "machine": machine_info(),
        "seed": args.seed, "args": {k: v for k, v in vars(args).items() if k != "func"},
        "label": (f"{args.size}: {args.model} on {args.device}, prompts "
                  f"{args.min_input_tokens}-{args.max_input_tokens} tokens, {args.output_len} out"
                  + ("; systems interleaved phase by phase" if args.interleave else
                     "; systems in turn")),
        "systems": {}}

    def write() -> None:
        write_results(report, args.out_dir)

    t0 = time.perf_counter()
    from tract_async.serving.protocol import REGION_MODES
    if any(s.mode in REGION_MODES for s in SYSTEMS if s.name in args.system_list):
        # Compile (or load from Numba's cache) the region kernels once, here: on a fresh host
        # six workers compiling them at once miss their own deadlines (README, "Cold Numba cache")
        from tract_async.tools.warmup import warm_up
        report["kernel_warmup_s"] = round(warm_up(backends=("hw",)), 1)
    try:
        tract.run(within_budget(lambda: run_all(args, report, write), args.budget, report))
    except Exception as exc:  # noqa: BLE001 - recorded, then re-reported by the exit status
        report["status"] = f"error: {type(exc).__name__}: {exc}"
    finally:
        _remove_leftover_regions()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write_records(report, args.out_dir)
    report["plots"] = write_report(report, args.out_dir, plots=not args.no_plots)
    out_json = write_results(report, args.out_dir)
    print(print_summary_table(report))
    print(f"status: {report['status']}; wrote {out_json}, summary.md"
          f"{''.join(', ' + os.path.basename(p) for p in report['plots'])} "
          f"({report['wall_s']:.0f} s)")
    servable = [e for e in report["systems"].values() if e.get("status") != "absent"]
    return 0 if report["status"] == "ok" and all(e.get("status") == "ok" for e in servable) else 1


__all__ = ["PRESETS", "SYSTEMS", "System", "build_parser", "main", "nixl_absent_reason",
           "resolve_args"]


if __name__ == "__main__":
    sys.exit(main())
