"""Disaggregated serving on the GPU: Llama-3-8B geometry (random bf16 weights), the same workers.

    python bench/serve_gpu.py                      # all three modes, ~3-5 min on one H200
    python bench/serve_gpu.py --modes region-cache --conversations 2 --turns 3

For each mode (http, region-transfer, region-cache) it starts a rack on 127.0.0.1 — a /dev/shm
region, a prefill worker and a decode worker on ``--device`` (both on one GPU by default: 2 x 16
GB of weights), a router — runs the multi-turn chat workload through ``/v1/completions``, and
stops the rack. It prints a TTFT table and each mode's layer timeline, and writes
``bench/results/serve-gpu-<time>.json`` after every mode, so a run cut short (deadline, a failed
mode, Ctrl-C) still leaves the modes that finished and the error of the one that did not.

Bounded: ``--budget`` (default 450 s) covers the whole run; a mode that has not finished when
the budget runs out is cancelled, its rack stopped, and the partial JSON written. KV moves through
``put_kv``/``get_kv`` with CUDA tensors when the engine takes them, else through ``.cpu()``
(the workers decide at the first put: ``serving.service.KVDevice``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS_DIR, leave_path, machine  # noqa: E402
leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import tract_async as tract  # noqa: E402
from tract_async.loadtest.runner import within_budget  # noqa: E402
from tract_async.serving.launcher import Rack  # noqa: E402
from tract_async.serving.protocol import MODES  # noqa: E402
from tract_async.serving.workload import (ChatWorkload, format_table, layer_timeline,  # noqa: E402
                                          run_chat_workload, summarize)

GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--system-chars", type=int, default=2000, help="~tokens of the shared prompt")
    p.add_argument("--user-chars", type=int, default=300)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--model", default="llama3-8b", choices=("llama3-8b", "tiny"),
                   help="tiny: a CPU smoke test of this script")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefill-device", default=None,
                   help="the prefill worker's device (default --device); e.g. cuda:0")
    p.add_argument("--decode-device", default=None,
                   help="the decode worker's device (default --device); e.g. cuda:1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--region-gib", type=float, default=4.0,
                   help="region size (capped at half of /dev/shm's free space)")
    p.add_argument("--kv-pool-gib", type=float, default=4.0, help="http mode: prefill's KV pool")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/serve-gpu-<time>.json)")
    return p.parse_args(argv)


def gpu_info() -> dict:
    try:
        import torch
        if not torch.cuda.is_available():
            return {"cuda": False}
        return {"cuda": True, "gpu": torch.cuda.get_device_name(0), "torch_cuda": torch.version.cuda,
                "gpus": torch.cuda.device_count()}
    except Exception as exc:  # report, do not fail the run over it
        return {"cuda": "error", "error": repr(exc)}


def region_bytes(want_gib: float) -> int:
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = int(want_gib * GIB) * 2
    return int(min(want_gib * GIB, free // 2)) // (2 << 20) * (2 << 20)


async def run(args: argparse.Namespace, report: dict, write) -> None:  # noqa: ANN001
    modes = [m for m in args.modes.split(",") if m]
    workload = ChatWorkload(conversations=args.conversations, turns=args.turns,
                            system_chars=args.system_chars, user_chars=args.user_chars,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    warmup = ChatWorkload(conversations=1, turns=1, max_new_tokens=2, system_chars=64,
                          seed=args.seed + 7919)
    log_dir = os.path.join(RESULTS_DIR, "serve-gpu-logs")
    rbytes = region_bytes(args.region_gib)
    report["region_bytes"] = rbytes
    placement = {"prefill": args.prefill_device or args.device,
                 "decode": args.decode_device or args.device}
    report["placement"] = placement       # which GPU each worker ran on: every figure says it
    for mode in modes:
        entry: dict = {"status": "started"}
        report["modes"][mode] = entry
        t0 = time.perf_counter()
        try:
            print(f"[{mode}] starting the rack ({args.model}; prefill on {placement['prefill']}, "
                  f"decode on {placement['decode']}) ...", flush=True)
            async with Rack(mode=mode, region=f"/dev/shm/tract-serve-gpu-{os.getpid()}-{mode}",
                            log_dir=log_dir, start_timeout_s=args.start_timeout, model=args.model,
                            device=args.device, dtype=args.dtype, seed=args.seed,
                            role_options={r: {"device": d} for r, d in placement.items()},
                            region_bytes=rbytes, kv_pool_bytes=int(args.kv_pool_gib * GIB),
                            layer_timeout_s=120.0, request_timeout_s=300.0) as rack:
                entry["start_s"] = time.perf_counter() - t0
                print(f"[{mode}] up in {entry['start_s']:.0f} s", flush=True)
                await run_chat_workload(rack.router_url, warmup, timeout=300.0)
                done: list = []

                def progress(r, mode=mode):  # noqa: ANN001
                    done.append(r)
                    print(f"[{mode}] {len(done):>3} prompt {r.prompt_tokens:>5} tok, hit "
                          f"{r.hit_blocks:>4}/{r.full_blocks:<4} blocks, TTFT {r.ttft_ms:8.1f} ms, "
                          f"e2e {r.e2e_ms:8.1f} ms", flush=True)
                    entry["requests"] = [dict(x.__dict__, token_ids=list(x.token_ids)) for x in done]

                res = await run_chat_workload(rack.router_url, workload, concurrency=args.concurrency,
                                              on_result=progress, timeout=300.0)
            entry.update(status="ok", summary=summarize(res), wall_s=time.perf_counter() - t0,
                         layer_timeline=layer_timeline(res[-1].events_ms))
        except asyncio.CancelledError:
            entry.update(status="cancelled (budget or signal)", wall_s=time.perf_counter() - t0)
            raise
        except Exception as exc:
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc(), wall_s=time.perf_counter() - t0)
            print(f"[{mode}] FAILED: {type(exc).__name__}: {exc}", flush=True)
        finally:
            if "requests" in entry and entry["status"] != "ok":
                from tract_async.serving.workload import TurnResult
                entry["summary_partial"] = summarize([TurnResult(**{**r, "token_ids": tuple(r["token_ids"])})
                                                      for r in entry["requests"]])
            write()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    out = args.out or os.path.join(RESULTS_DIR, time.strftime("serve-gpu-%Y%m%d-%H%M%S.json"))
    report: dict = {"bench": "serve_gpu", "args": vars(args), "machine": machine(),
                    "gpu": gpu_info(), "modes": {}, "status": "running"}

    def write() -> None:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(tmp, out)

    t0 = time.perf_counter()
    try:
        tract.run(within_budget(lambda: run(args, report, write), args.budget, report))
    except Exception as exc:
        report["status"] = f"error: {type(exc).__name__}: {exc}"
    report["wall_s"] = time.perf_counter() - t0
    write()
    done = {m: e["summary"] for m, e in report["modes"].items() if "summary" in e}
    print()
    if done:
        print(format_table(done))
        pl = report.get("placement", {})
        print(f"  placement: prefill on {pl.get('prefill')}, decode on {pl.get('decode')}"
              + (" (one GPU, time-shared)" if pl.get("prefill") == pl.get("decode") else ""))
        for m, e in report["modes"].items():
            if "layer_timeline" in e:
                print(f"  {m:<16} {e['layer_timeline']}")
    for m, e in report["modes"].items():
        if e.get("status") != "ok":
            print(f"  {m}: {e.get('status')} {e.get('error', '')}")
    print(f"status: {report['status']}; wrote {out} ({report['wall_s']:.0f} s)")
    return 0 if report["status"] == "ok" and all(e.get("status") == "ok" for e in report["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
