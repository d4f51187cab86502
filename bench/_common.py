"""Shared benchmark plumbing: machine details, medians, a printed table, JSON under results/."""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def leave_path() -> None:
    """Take bench/ off ``sys.path`` (a script calls it once its siblings are imported):
    ``bench/kernels.py`` would shadow the ``kernels`` package that transformers probes for, and
    a transformers of the CI venv's version then fails to import (``ImportError:
    CUDAProperties``; the clean-clone CI of 0530fc6, ``bench/results/vm-20261208-s55``)."""
    sys.path[:] = [d for d in sys.path if os.path.abspath(d or os.curdir) != BENCH_DIR]


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return None


def commit() -> str:
    """The commit a result belongs to: ``TRACT_GIT_COMMIT`` (a tree copied without its .git),
    else the checkout's HEAD, else ``nocommit``."""
    return os.environ.get("TRACT_GIT_COMMIT") or _git_head() or "nocommit"


def llama_layout() -> Any:
    """The Llama-3-8B geometry the GPU benchmarks move: 32 layers, 16-token blocks, 8 KV heads
    x 128, bf16 (64 KiB per block and layer)."""
    import torch
    import tract_async as tract
    return tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128,
                          dtype=torch.bfloat16)


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, versions, date: enough to compare runs across machines."""
    info: dict[str, Any] = {"hostname": socket.gethostname(), "python": sys.version.split()[0],
                            "platform": platform.platform(), "cores": os.cpu_count(),
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    for mod in ("numpy", "numba", "torch", "aiohttp", "uvloop"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    info["git"] = _git_head()
    # a copy of the tree without its own .git (the device hosts): the caller names the commit
    if os.environ.get("TRACT_GIT_COMMIT"):
        info["git_from_env"] = info.get("git")
        info["git"] = os.environ["TRACT_GIT_COMMIT"]
    try:
        import torch
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    # the engine's A/B switches (TRACT_CUDA_EARLY, TRACT_CUDA_WHOLE, TRACT_CUDA_BATCH, ...) as
    # this run had them: a result file of an A/B says which side it is
    info["tract_env"] = {k: v for k, v in sorted(os.environ.items())
                         if k.startswith("TRACT_") and "SECRET" not in k}
    return info


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols}
    out = ["  ".join(c.rjust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    out += ["  ".join(fmt(r.get(c, "")).rjust(widths[c]) for c in cols) for r in rows]
    return "\n".join(out)


_RUN_PATHS: dict[str, str] = {}
"""This process's result file per name (``write_json``): a run that saves as it goes rewrites
its own file, never another run's."""


def read_text(path: str) -> str:
    """A small sysfs / procfs file's text, stripped; ``? (<why>)`` where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"? ({e.strerror})"


def result_path(name: str) -> str:
    """``bench/results/<name>-<YYYYmmdd-HHMMSS>-<commit>.json`` for this run (the same path on
    every call in one process), never an existing file: results are records, and a later run
    must not overwrite the file an earlier figure cites."""
    path = _RUN_PATHS.get(name)
    if path is None:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        base = os.path.join(RESULTS_DIR, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{commit()[:12]}")
        path, k = base + ".json", 1
        while os.path.exists(path):
            k += 1
            path = f"{base}-{k}.json"
        _RUN_PATHS[name] = path
    return path


def write_json(name: str, payload: dict[str, Any]) -> str:
    """Write this run's result ``name`` (``result_path``, machine details included); returns
    the path."""
    path = result_path(name)
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=1, default=str)
    return path


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n //= 1024
    return str(n)
