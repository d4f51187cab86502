"""The load benchmark's written report: machine details, the files of a run (``results.json``,
``records.jsonl``, ``summary.md``, the plots), the console table, and recomputing a finished
run's metrics from its records.

Every figure is compared with the ``http`` row of the same phase of the same run (the measured
network stand-in), never with a number from another run or another machine: CPU figures on a
shared VM move by tens of percent between runs. Systems that did not run are listed with the
reason, so a missing row is never silent.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Any

from tract_async.loadtest.stats import COMPONENTS

_VERSIONED = ("torch", "transformers", "numpy", "numba", "aiohttp", "orjson", "uvloop", "tqdm",
              "matplotlib", "pynvml", "nixl")


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare two runs: CPU, cores, memory, GPU, versions, commit."""
    from importlib.metadata import PackageNotFoundError, version
    info: dict[str, Any] = {"hostname": platform.node(),
                            "python": sys.version.split()[0], "platform": platform.platform(),
                            "cores": os.cpu_count(),
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            # other work on a shared host moves every figure: say how much
                            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                                if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    versions = {}
    for name in _VERSIONED:
        try:
            versions[name] = version(name if name != "pynvml" else "nvidia-ml-py")
        except PackageNotFoundError:
            versions[name] = None
    info["versions"] = versions
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                     capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    # a copy of the tree whose .git is stale or absent (the device hosts): the caller names it
    if os.environ.get("TRACT_GIT_COMMIT"):
        info["git_from_tree"] = info["git"]
        info["git"] = os.environ["TRACT_GIT_COMMIT"]
    try:
        import torch
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a report, never a failure
        info["gpu"] = None
    return info


def _ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _num(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def phase_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (system, phase) that ran, with its speed-up over ``http`` in the same phase."""
    http = {p["phase"]: p["summary"] for p in report["systems"].get("http", {}).get("phases", [])}
    rows = []
    for name, entry in report["systems"].items():
        for p in entry.get("phases", []):
            s = p["summary"]
            base = http.get(p["phase"])
            speedup = (base["ttft_mean_ms"] / s["ttft_mean_ms"]
                       if base and s["ttft_mean_ms"] and not math.isnan(s["ttft_mean_ms"])
                       and not math.isnan(base["ttft_mean_ms"]) else math.nan)
            p99_speedup = (base["ttft_p99_ms"] / s["ttft_p99_ms"]
                           if base and s["ttft_p99_ms"] and not math.isnan(s["ttft_p99_ms"])
                           and not math.isnan(base["ttft_p99_ms"]) else math.nan)
            lock = sum(v.get("lock_wait_s", 0.0) for v in p.get("engine", {}).values())
            rows.append({"system": name, "workload": p["workload"], "load": p["label"],
                         "phase": p["phase"], "s": s, "speedup": speedup,
                         "p99_speedup": p99_speedup, "lock_wait_ms": lock * 1e3})
    return rows


def markdown_summary(report: dict[str, Any]) -> str:
    """The ``summary.md`` of a run: the label, the table, the breakdown, what did not run."""
    m = report["machine"]
    lines = [f"# tract bench serve: {report.get('label', '')}", "",
             f"{m.get('cpu') or '?'} x {m.get('cores')} cores, {m.get('mem_total_gib')} GiB"
             f"{', GPU ' + m['gpu'] if m.get('gpu') else ', no GPU'}; torch "
             f"{m['versions'].get('torch')}; commit {m.get('git')}; {m.get('date')}; load "
             f"average {m.get('loadavg_start')} at the start, {report.get('loadavg_end')} at the "
             f"end; seed {report.get('seed')}; status: {report.get('status')}"
             + (f"; metrics recomputed from records.jsonl at commit "
                f"{report['resummarized']['git']}" if report.get("resummarized") else ""), "",
             *_parts_lines(report),
             f"TTFT is client-side (request written -> first token read). Speed-ups are the "
             f"`http` row's TTFT over the system's, same phase, same run. Goodput: requests with "
             f"TTFT <= {report['args'].get('ttft_slo_ms')} ms per second. Hit rate: measured "
             f"(ideal for the workload). `rdma-model` is a model, not a measurement.", "",
             "| system | workload | load | ok | TTFT mean | p50 | p90 | p99 | mean vs http | "
             "p99 vs http | TPOT mean | req/s | out tok/s | goodput | hit rate | KV MiB | "
             "lock wait ms |",
             "|" + "---|" * 17]
    for r in phase_rows(report):
        s = r["s"]
        lines.append(
            f"| {r['system']} | {r['workload']} | {r['load']} | {s['completed']}/{s['requests']} "
            f"| {_ms(s['ttft_mean_ms'])} | {_ms(s['ttft_p50_ms'])} | {_ms(s['ttft_p90_ms'])} "
            f"| {_ms(s['ttft_p99_ms'])} | {_num(r['speedup'])}x | {_num(r['p99_speedup'])}x "
            f"| {_ms(s['tpot_mean_ms'])} | {_num(s['throughput_rps'])} "
            f"| {_num(s['output_tok_s'], 0)} "
            f"| {_num(s['goodput_rps'])} | {s['hit_rate']:.0%} ({s['ideal_hit_rate']:.0%}) "
            f"| {_mib(s['kv_bytes'])} | {_num(r['lock_wait_ms'], 1)} |")
    lines += ["", "Mean per-request breakdown (ms; durations, not a partition: with layer "
              "streaming the KV store overlaps the compute, and what the components leave of the "
              "TTFT is the HTTP hops between client, router and workers):", "",
              "| system | workload | load | " + " | ".join(COMPONENTS) + " | TTFT mean |",
              "|" + "---|" * (4 + len(COMPONENTS))]
    for r in phase_rows(report):
        b = r["s"]["breakdown_mean_ms"]
        lines.append(f"| {r['system']} | {r['workload']} | {r['load']} | "
                     + " | ".join(_ms(b[c]) for c in COMPONENTS)
                     + f" | {_ms(r['s']['ttft_mean_ms'])} |")
    missing = [(n, e) for n, e in report["systems"].items() if e.get("status") != "ok"]
    if missing:
        lines += ["", "Systems without a complete result:", ""]
        lines += [f"- `{n}` ({e.get('status')}): {e.get('reason', '')}" for n, e in missing]
    errors = [(r["system"], r["load"], r["s"]["errors"]) for r in phase_rows(report)
              if r["s"]["errors"]]
    if errors:
        lines += ["", "Request errors:", ""]
        lines += [f"- `{n}` {load}: {'; '.join(errs)}" for n, load, errs in errors]
    agreement = output_agreement(report)
    if agreement["compared"]:
        lines += ["", f"Greedy outputs: {agreement['agree']} of {agreement['compared']} requests "
                      f"served by several systems got the same tokens from every one."]
        lines += [f"- differ: `{d['workload']}` {d['load']} request {d['index']}: "
                  f"{', '.join(d['differ'])} unlike {d['reference']}"
                  for d in agreement["differ"][:10]]
    tel = report.get("telemetry", {})
    lines += ["", "GPU PCIe telemetry: " + (
        f"{tel.get('samples')} NVML samples; RX max {_num(tel.get('pcie_rx_mbs_max', math.nan), 0)}"
        f" MB/s, TX max {_num(tel.get('pcie_tx_mbs_max', math.nan), 0)} MB/s"
        if tel.get("available") else f"absent ({tel.get('reason')})"), ""]
    return "\n".join(lines)


def print_summary_table(report: dict[str, Any]) -> str:
    """A compact console table (the Markdown file has every column)."""
    head = (f"{'system':<16} {'workload':<8} {'load':<11} {'ok':>5} {'TTFT mean':>9} {'p99':>8} "
            f"{'vs http':>7} {'req/s':>6} {'tok/s':>6} {'hit':>5}")
    out = [head, "-" * len(head)]
    for r in phase_rows(report):
        s = r["s"]
        out.append(f"{r['system']:<16} {r['workload']:<8} {r['load']:<11} "
                   f"{s['completed']:>2}/{s['requests']:<2} {_ms(s['ttft_mean_ms']):>9} "
                   f"{_ms(s['ttft_p99_ms']):>8} {_num(r['speedup']):>6}x "
                   f"{_num(s['throughput_rps']):>6} {_num(s['output_tok_s'], 0):>6} "
                   f"{s['hit_rate']:>5.0%}")
    for name, e in report["systems"].items():
        if e.get("status") != "ok":
            out.append(f"{name:<16} {e.get('status')}: {e.get('reason', '')}")
    return "\n".join(out)


def _parts_lines(report: dict[str, Any]) -> list[str]:
    """For a merged report (``loadmerge``): which part measured which systems, where."""
    parts = report.get("parts")
    if not parts:
        return []
    out = [f"Merged from {len(parts)} runs:", ""]
    for i, p in enumerate(parts):
        m = p["machine"]
        out.append(f"- part {i} (`{p['dir']}`, {p['status']}): {', '.join(p['systems'])}; host "
                   f"{m.get('hostname')}, {m.get('gpu') or 'no GPU'}, commit {m.get('git')}, "
                   f"{m.get('date')}")
    if not report.get("parts_same_host", True):
        out += ["", "**The parts ran on different hosts**: compare figures only within a part "
                    "(lent hosts of one kind differ widely)."]
    return out + [""]


def output_agreement(report: dict[str, Any]) -> dict[str, Any]:
    """Whether every system generated the same tokens for the same request (same seed, same
    prompts: greedy outputs must not depend on how the KV travelled, issue 38). Compares the
    completed requests of each ``(workload, load, index)`` that at least two systems served;
    records without ``output_ids`` (runs before they were kept) are not compared."""
    outs: dict[tuple[str, str, int], dict[str, list[int]]] = {}
    for name, entry in report["systems"].items():
        for p in entry.get("phases", []):
            for r in p.get("records", []):
                if r.get("error") is None and r.get("output_ids"):
                    outs.setdefault((p["workload"], p["label"], r["index"]), {})[name] = \
                        r["output_ids"]
    compared = {k: v for k, v in outs.items() if len(v) >= 2}
    differ = []
    for (workload, load, index), by_system in sorted(compared.items()):
        first_name, first = next(iter(by_system.items()))    # the report's first system
        odd = sorted(n for n, ids in by_system.items() if ids != first)
        if odd:
            differ.append({"workload": workload, "load": load, "index": index,
                           "reference": first_name, "differ": odd})
    return {"compared": len(compared), "agree": len(compared) - len(differ), "differ": differ}


def write_results(report: dict[str, Any], out_dir: str) -> str:
    """``results.json``: everything but the per-request records (small enough to commit next
    to the README); written atomically, so a reader never sees half a file."""
    slim = {**report, "systems": {n: {**e, "phases": [
        {k: v for k, v in p.items() if k != "records"} for p in e.get("phases", [])]}
        for n, e in report["systems"].items()}}
    if any(p.get("records") for e in report["systems"].values() for p in e.get("phases", [])):
        slim["outputs"] = output_agreement(report)
    path = os.path.join(out_dir, "results.json")
    with open(path + ".tmp", "w") as f:
        json.dump(slim, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def write_records(report: dict[str, Any], out_dir: str) -> None:
    """``records.jsonl``: one request per line, with its system, phase and load."""
    with open(os.path.join(out_dir, "records.jsonl"), "w") as f:
        for name, entry in report["systems"].items():
            for p in entry.get("phases", []):
                for r in p["records"]:
                    f.write(json.dumps({"system": name, "phase": p["phase"], "load": p["label"],
                                        **r}, default=str) + "\n")


def write_report(report: dict[str, Any], out_dir: str, *, plots: bool = True) -> list[str]:
    """``summary.md`` and the plots; returns the plots' paths."""
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown_summary(report))
    if not plots:
        return []
    from tract_async.loadtest.plots import write_plots
    return write_plots(report, out_dir)


def resummarize(out_dir: str) -> dict[str, Any]:
    """Recompute every phase's metrics of a finished run from its ``records.jsonl`` (metrics
    are a function of the records alone: a corrected definition needs no new run), then
    rewrite ``results.json``, ``summary.md`` and the plots. The report notes the commit that
    recomputed it. Raises FileNotFoundError (no such run) or KeyError (a record of a phase the
    results do not list)."""
    from tract_async.loadtest.generator import RequestRecord
    from tract_async.loadtest.stats import summarize
    with open(os.path.join(out_dir, "results.json")) as f:
        report = json.load(f)
    # a float that was NaN comes back as null from a strict JSON writer: NaN again
    floats = {f.name for f in dataclasses.fields(RequestRecord) if f.type in ("float", float)}
    by_phase: dict[tuple[str, int], list[RequestRecord]] = {}
    with open(os.path.join(out_dir, "records.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            key = (r.pop("system"), r.pop("phase"))
            r.pop("load")
            r.update({k: math.nan for k in floats if r.get(k, 0.0) is None})
            by_phase.setdefault(key, []).append(RequestRecord(**r))
    for name, entry in report["systems"].items():
        for p in entry.get("phases", []):
            recs = by_phase.pop((name, p["phase"]))
            old = p["summary"]
            p["summary"] = {**summarize(recs, ttft_slo_ms=report["args"]["ttft_slo_ms"]),
                            "ideal_hit_rate": old["ideal_hit_rate"], "wall_s": old.get("wall_s")}
            p["records"] = [r.to_json() for r in recs]
    if by_phase:
        raise KeyError(f"records of phases the results do not list: {sorted(by_phase)[:5]}")
    m = machine_info()
    report["resummarized"] = {"git": m.get("git"), "date": m.get("date")}
    report["plots"] = write_report(report, out_dir)
    write_results(report, out_dir)
    return report


__all__ = ["machine_info", "markdown_summary", "output_agreement", "phase_rows", "print_summary_table", "resummarize",
           "write_records", "write_report", "write_results"]
