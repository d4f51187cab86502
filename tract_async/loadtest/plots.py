"""The load benchmark's figures (matplotlib, Agg: no display), after the paper's:

* ``ttft_cdf.png``: TTFT CDF per system, one panel per workload, at each workload's first load
  (Figures 5 and 9);
* ``rate_sweep.png``: throughput and TTFT (mean and p99) against the offered request rate,
  open-loop phases only (Figure 6);
* ``peak_throughput.png``: the best closed-loop throughput per system (Figure 7), when a closed
  loop ran;
* ``hit_rate.png``: prefix hit rate per workload and system, the workload's ideal marked
  (Figure 8);
* ``breakdown.png``: mean per-request components per system, TTFT marked (Figure 10);
* ``pcie.png``: GPU PCIe RX/TX over the run, only when NVML sampled something (Figure 11).

Small on purpose (dpi 90): these files are committed next to the README.
"""
from __future__ import annotations

import math
import os
from typing import Any

from tract_async.loadtest.stats import COMPONENTS

_DPI = 90


def _plt() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _systems(report: dict[str, Any]) -> list[str]:
    return [n for n, e in report["systems"].items() if e.get("phases")]


def _workloads(report: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for e in report["systems"].values():
        for p in e.get("phases", []):
            if p["workload"] not in seen:
                seen.append(p["workload"])
    return seen


def _first_phase(entry: dict[str, Any], workload: str) -> dict[str, Any] | None:
    return next((p for p in entry.get("phases", []) if p["workload"] == workload), None)


def _ok_ttfts_ms(phase: dict[str, Any]) -> list[float]:
    return sorted((r["first_token_s"] - r["sent_s"]) * 1e3 for r in phase["records"]
                  if r["error"] is None and r["output_tokens"] > 0)


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    _plt().close(fig)
    return path


def plot_ttft_cdf(report: dict[str, Any], path: str) -> str | None:
    plt = _plt()
    workloads = _workloads(report)
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 3.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        label = ""
        for name in _systems(report):
            phase = _first_phase(report["systems"][name], w)
            if phase is None:
                continue
            xs = _ok_ttfts_ms(phase)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
            label = phase["label"]
        ax.set_title(f"{w} @ {label}", fontsize=9)
        ax.set_xlabel("TTFT (ms)")
        ax.set_xlim(left=0)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path)


def plot_rate_sweep(report: dict[str, Any], path: str) -> str | None:
    plt = _plt()
    def rates(w: str) -> set[float]:
        return {p["value"] for e in report["systems"].values() for p in e.get("phases", [])
                if p["workload"] == w and p["loop"] == "open" and not math.isinf(p["value"])}
    workloads = [w for w in _workloads(report) if len(rates(w)) > 1]   # a sweep, not a point
    if not workloads:
        return None
    fig, axes = plt.subplots(2, len(workloads), figsize=(3.6 * len(workloads), 5.4), squeeze=False)
    for col, w in enumerate(workloads):
        for name in _systems(report):
            pts = sorted(((p["value"], p["summary"]) for p in report["systems"][name]["phases"]
                          if p["workload"] == w and p["loop"] == "open"
                          and not math.isinf(p["value"])), key=lambda vs: vs[0])
            if not pts:
                continue
            rates = [r for r, _ in pts]
            line = axes[0][col].plot(rates, [s["throughput_rps"] for _, s in pts], "o-", label=name)
            color = line[0].get_color()
            axes[1][col].plot(rates, [s["ttft_mean_ms"] for _, s in pts], "o-", color=color)
            axes[1][col].plot(rates, [s["ttft_p99_ms"] for _, s in pts], "x--", color=color,
                              alpha=0.6)
        axes[0][col].set_title(w, fontsize=9)
        axes[0][col].set_ylabel("completed req/s")
        axes[1][col].set_ylabel("TTFT ms (o mean, x p99)")
        axes[1][col].set_yscale("log")
        for ax in axes[:, col]:
            ax.set_xlabel("offered req/s (Poisson)")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path)


def plot_peak_throughput(report: dict[str, Any], path: str) -> str | None:
    plt = _plt()
    best: dict[str, tuple[float, float]] = {}
    for name in _systems(report):
        closed = [p["summary"] for p in report["systems"][name]["phases"] if p["loop"] == "closed"]
        if closed:
            top = max(closed, key=lambda s: -1.0 if math.isnan(s["output_tok_s"])
                      else s["output_tok_s"])
            best[name] = (top["throughput_rps"], top["output_tok_s"])
    if not best:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.0))
    names = list(best)
    axes[0].bar(names, [best[n][0] for n in names])
    axes[0].set_ylabel("req/s (closed loop, best)")
    axes[1].bar(names, [best[n][1] for n in names])
    axes[1].set_ylabel("output tok/s")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_hit_rate(report: dict[str, Any], path: str) -> str | None:
    plt = _plt()
    workloads, systems = _workloads(report), _systems(report)
    if not workloads:
        return None
    fig, ax = plt.subplots(figsize=(1.8 + 1.4 * len(workloads), 3.0))
    width = 0.8 / max(1, len(systems))
    for i, name in enumerate(systems):
        vals = []
        for w in workloads:
            ps = [p["summary"] for p in report["systems"][name]["phases"] if p["workload"] == w]
            hits = sum(s["hit_blocks"] for s in ps)
            full = sum(s["full_blocks"] for s in ps)
            vals.append(hits / full if full else 0.0)
        ax.bar([j + i * width for j in range(len(workloads))], vals, width, label=name)
    for j, w in enumerate(workloads):
        ideal = next((p["summary"]["ideal_hit_rate"] for e in report["systems"].values()
                      for p in e.get("phases", []) if p["workload"] == w), None)
        if ideal is not None:
            ax.hlines(ideal, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("prefix hit rate (blocks; dotted: ideal)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_breakdown(report: dict[str, Any], path: str) -> str | None:
    plt = _plt()
    workloads, systems = _workloads(report), _systems(report)
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 3.4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        names, label = [], ""
        phases = []
        for name in systems:
            phase = _first_phase(report["systems"][name], w)
            if phase is not None:
                names.append(name)
                phases.append(phase)
                label = phase["label"]
        bottoms = [0.0] * len(names)
        for comp in COMPONENTS:
            vals = [p["summary"]["breakdown_mean_ms"][comp] for p in phases]
            vals = [0.0 if v != v else v for v in vals]
            ax.bar(names, vals, bottom=bottoms, label=comp)
            bottoms = [b + v for b, v in zip(bottoms, vals)]
        ax.plot(names, [p["summary"]["ttft_mean_ms"] for p in phases], "k_", markersize=18,
                markeredgewidth=2, label="TTFT mean")
        ax.set_title(f"{w} @ {label}", fontsize=9)
        ax.set_ylabel("ms per request")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    axes[0][-1].legend(fontsize=6)
    return _save(fig, path)


def plot_pcie(report: dict[str, Any], path: str) -> str | None:
    tel = report.get("telemetry", {})
    series = tel.get("series") or {}
    if not tel.get("available") or not series.get("t_s"):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    ax.plot(series["t_s"], series["pcie_rx_mbs"], label="RX (to GPU)")
    ax.plot(series["t_s"], series["pcie_tx_mbs"], label="TX (from GPU)")
    for t, name in tel.get("marks", []):
        ax.axvline(t, color="grey", alpha=0.3)
        ax.text(t, ax.get_ylim()[1] * 0.95, name, fontsize=5, rotation=90, va="top")
    ax.set_xlabel("s")
    ax.set_ylabel("PCIe MB/s (NVML)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def write_plots(report: dict[str, Any], out_dir: str) -> list[str]:
    """Every figure that has data; returns the paths written."""
    makers = (("ttft_cdf.png", plot_ttft_cdf), ("rate_sweep.png", plot_rate_sweep),
              ("peak_throughput.png", plot_peak_throughput), ("hit_rate.png", plot_hit_rate),
              ("breakdown.png", plot_breakdown), ("pcie.png", plot_pcie))
    out = []
    for name, make in makers:
        path = make(report, os.path.join(out_dir, name))
        if path:
            out.append(path)
    return out


__all__ = ["write_plots"]
