"""``tract demo``: disaggregated serving of a (tiny, random-weight) Llama on loopback, in each mode.

For every mode (``http``: KV over the NIXL-style agent; ``region-transfer``: through the shared
region, no cache; ``region-cache``: through the region, with the rack-wide prefix cache) it starts
a rack — a ``/dev/shm`` region, a prefill worker, a decode worker and a router, each a separate
process on 127.0.0.1 — runs the same multi-turn chat workload against the router's
``/v1/completions``, and stops the rack. Then it prints a TTFT table, one request's layer timeline
per mode, whether every mode produced the same tokens, and writes a TTFT CDF plot and a JSON file.

Cleanup: a Ctrl-C or SIGTERM cancels the run; the services are stopped (SIGTERM, then SIGKILL
after a deadline) and the region file removed on every exit path; the services also get SIGTERM
from the kernel if this process dies without cleaning up. The exit status then says which
signal stopped it, as a shell would: 130 for SIGINT, 143 for SIGTERM. A SIGKILLed demo cleans up
nothing: its region files name its pid, and the next ``tract demo`` removes those of demo runs
whose process is gone (``remove_dead_runs``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from typing import Any

from .serving.protocol import MODES
from .units import SIZE_HELP, parse_size


def add_demo_parser(subparsers: Any) -> None:
    """Register ``tract demo`` on the ``tract`` command's subparsers."""
    p = subparsers.add_parser("demo", help="run prefill/decode/router on loopback in each mode "
                              "and print TTFT (http vs region transfer vs region prefix cache)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    p.add_argument("--conversations", type=int, default=4, help="chats (default 4)")
    p.add_argument("--turns", type=int, default=4, help="turns per chat (default 4)")
    p.add_argument("--concurrency", type=int, default=1, help="chats in flight at once (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens per reply (default 8)")
    p.add_argument("--system-chars", type=int, default=600, help="shared system prompt length")
    p.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    p.add_argument("--region-bytes", type=parse_size, default=parse_size("256M"),
                   help=f"size of each mode's region: {SIZE_HELP}; default 256M")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--out-dir", default="tract-demo-out",
                   help="where the plot, JSON and service logs go (default ./tract-demo-out)")
    p.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds per service start (default 120)")
    p.set_defaults(func=run_demo, _parser=p)


def run_demo(args: argparse.Namespace) -> int:
    """Raises MissingExtra (before anything starts) without the serve extra."""
    import tract_async as tract
    from .extras import check_installed
    check_installed(("torch", "transformers", "prometheus_client", "matplotlib"), purpose="tract demo")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"tract demo: unknown mode(s) {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    remove_dead_runs(_region_dir())
    seen: list[int] = []
    try:
        return tract.run(_main(args, modes, seen))
    except (KeyboardInterrupt, asyncio.CancelledError):   # SIGINT/SIGTERM: cleaned up already
        return stopped_status(seen)


def _region_dir() -> str:
    """Where the demo's regions go: ``/dev/shm``, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_RUN_FILE = re.compile(r"tract-demo-(?:warm-(\d+)|(\d+)-(?:" + "|".join(map(re.escape, MODES))
                       + r"))(?:\.cpumarks)?")
"""The files of one demo run in its region directory, each naming the run's pid: its regions
``tract-demo-<pid>-<mode>``, its warm-up region ``tract-demo-warm-<pid>``, and each one's
``<path>.cpumarks`` record (``region.cpumarks.sidecar_path``)."""


def _pid_is_gone(pid: int) -> bool:
    """True only when no process has this pid (a process of another user exists: False)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):   # another user's process, or no pid at all: keep
        return False
    return False


def remove_dead_runs(region_dir: str) -> list[str]:
    """Remove from ``region_dir`` the region files (and ``.cpumarks`` records) that demo runs
    left when they died without cleaning up (SIGKILL, OOM), and say so in one line; return the
    names removed. A file goes only when the pid in its name has no process now: a live demo's
    files stay (this process's too), and so do those of a dead run whose pid another process
    took (a later run removes them). Not for a ``/dev/shm`` shared with another pid namespace:
    a pid there means nothing here."""
    removed: list[str] = []
    freed = 0
    try:
        names = sorted(os.listdir(region_dir))
    except OSError:
        return removed
    gone: dict[int, bool] = {}
    for name in names:
        m = _RUN_FILE.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group(1) or m.group(2))
        if pid not in gone:
            gone[pid] = _pid_is_gone(pid)
        if not gone[pid]:
            continue
        path = os.path.join(region_dir, name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            continue
        removed.append(name)
        freed += size
    if removed:
        print(f"tract demo: removed {len(removed)} file(s) ({freed / (1 << 20):.0f} MiB) left in "
              f"{region_dir} by demo runs that are gone: {', '.join(removed)}", flush=True)
    return removed


def stopped_status(seen: list[int]) -> int:
    """The exit status of a demo stopped by the signals in ``seen`` (the first one counts):
    128 + its number, as a shell reports a process that signal ended -- 130 for SIGINT (also
    a Ctrl-C that reached Python as KeyboardInterrupt before any handler saw it), 143 for
    SIGTERM."""
    return 128 + (seen[0] if seen else int(signal.SIGINT))


def _install_cancel_on_signals(seen: list[int] | None = None) -> tuple[asyncio.Event, list[int]]:
    """SIGINT/SIGTERM cancel the running demo task (once; cleanup then runs to the end). The
    signals received are appended to ``seen`` (a new list if None), which is returned."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    fired = asyncio.Event()
    seen = [] if seen is None else seen

    def on_signal(signum: int) -> None:
        seen.append(signum)
        if not fired.is_set():
            fired.set()
            print(f"\n{signal.Signals(signum).name}: stopping the services and removing the region ...",
                  flush=True)
            if task is not None:
                task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return fired, seen


async def _warm_kernels(region_dir: str) -> None:
    """Compile (or load from Numba's cache) the region kernels once, here, so that the services
    do not all compile them at the same time on a fresh machine."""
    import torch

    import tract_async as tract
    path = os.path.join(region_dir, f"tract-demo-warm-{os.getpid()}")
    layout = tract.KVLayout(num_layers=2, block_tokens=4, kv_heads=1, head_dim=8, dtype=torch.float32)
    try:
        cfg = tract.EngineConfig(layout=layout, region=path, region_bytes=16 << 20, create=True,
                                 namespace="warm", liveness_timeout_s=10.0)
        async with tract.Engine.open(cfg) as eng:
            keys = eng.block_keys(list(range(8)))
            kv = torch.zeros(layout.kv_shape(len(keys)))
            await eng.put_kv(keys, kv[0], layer=0)
            await eng.put_kv(keys, kv[1], layer=1)
            eng.lookup(keys)
            await eng.get_kv(keys, layer=1, timeout=5.0)
            await eng.get_kv(keys)
    finally:
        from tract_async.region.region import discard
        discard(path)


async def _main(args: argparse.Namespace, modes: list[str], seen: list[int]) -> int:
    from .serving.launcher import Rack
    from .serving.workload import (ChatWorkload, format_table, layer_timeline, plot_cdf,
                                   run_chat_workload, summarize)
    _install_cancel_on_signals(seen)
    t_start = time.perf_counter()
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    log_dir = os.path.join(out_dir, "logs")
    region_dir = _region_dir()
    workload = ChatWorkload(conversations=args.conversations, turns=args.turns,
                            max_new_tokens=args.max_new_tokens, system_chars=args.system_chars,
                            seed=args.seed)
    warmup = ChatWorkload(conversations=1, turns=1, max_new_tokens=2, system_chars=64,
                          seed=args.seed + 7919)
    total = workload.conversations * workload.turns
    print(f"tract demo: tiny Llama (4 layers, random weights, seed {args.seed}) on the CPU; "
          f"{workload.conversations} chats x {workload.turns} turns, {workload.max_new_tokens} "
          f"new tokens each; modes: {', '.join(modes)}", flush=True)
    if any(m != "http" for m in modes):
        from .tools.warmup import notice_if_cold
        t = time.perf_counter()
        notice_if_cold()   # the warm-up below compiles for tens of seconds on a cold cache
        await _warm_kernels(region_dir)
        print(f"  region kernels ready ({time.perf_counter() - t:.1f} s)", flush=True)
    results: dict[str, Any] = {}
    for mode in modes:
        region = os.path.join(region_dir, f"tract-demo-{os.getpid()}-{mode}")
        t = time.perf_counter()
        print(f"[{mode}] starting region, prefill, decode, router ...", flush=True)
        async with Rack(mode=mode, region=region, log_dir=log_dir,
                        start_timeout_s=args.start_timeout, seed=args.seed,
                        region_bytes=args.region_bytes, block_tokens=args.block_tokens,
                        torch_threads=1) as rack:
            print(f"[{mode}] up in {time.perf_counter() - t:.1f} s; router {rack.router_url}",
                  flush=True)
            await run_chat_workload(rack.router_url, warmup)   # first-request costs, not counted
            done = [0]

            tty = sys.stdout.isatty()

            def progress(r: Any, mode: str = mode, tty: bool = tty) -> None:
                done[0] += 1
                if not tty and done[0] % workload.turns and done[0] != total:
                    return   # a log gets one line per chat, a terminal a live line
                print(f"{chr(13) if tty else ''}[{mode}] {done[0]:>3}/{total} requests  last: "
                      f"{r.prompt_tokens:>5} prompt tokens, {r.hit_blocks:>3}/{r.full_blocks:<3} "
                      f"blocks hit, TTFT {r.ttft_ms:7.1f} ms", end="" if tty else "\n", flush=True)

            res = await run_chat_workload(rack.router_url, workload, concurrency=args.concurrency,
                                          on_result=progress)
            if tty:
                print(flush=True)
        results[mode] = res
    summaries = {m: summarize(r) for m, r in results.items()}
    print()
    print("TTFT (router: request received -> first token written to the client)")
    print(format_table(summaries))
    print()
    print("layer streaming, last request of each mode (ms after the router received it):")
    for mode, res in results.items():
        print(f"  {mode:<16} {layer_timeline(res[-1].events_ms)}")
    outputs = {m: [r.token_ids for r in res] for m, res in results.items()}
    same = len({tuple(v) for v in outputs.values()}) == 1
    print(f"\ngreedy outputs identical across modes: {'yes' if same else 'NO'}")
    png = os.path.join(out_dir, "ttft_cdf.png")
    plot_cdf({m: [r.ttft_ms for r in res] for m, res in results.items()}, png,
             title="tract demo: TTFT CDF (tiny Llama, CPU)")
    js = os.path.join(out_dir, "demo_results.json")
    with open(js, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()
                            if k != "func" and not k.startswith("_")},
                   "summaries": summaries, "outputs_identical": same,
                   "requests": {m: [r.__dict__ | {"token_ids": list(r.token_ids)} for r in res]
                                for m, res in results.items()}}, f, indent=1)
    print(f"wrote {png} and {js} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0 if same else 1
