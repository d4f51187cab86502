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
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
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


def write_json(name: str, payload: dict[str, Any]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=1, default=str)
    return path


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n //= 1024
    return str(n)
