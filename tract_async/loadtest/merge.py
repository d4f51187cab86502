"""One report from several runs of the load benchmark (``tract bench serve --merge``).

Why: the whole evaluation (every system, every phase, on the Llama-3-8B geometry) does not fit
one 10-minute call of a lent GPU host, so it runs as named parts (each a ``--systems`` subset
with the same workload options, each in its own ``--out-dir``) and this merges them: each system
comes from exactly one part, with its records, and every metric, table and plot is recomputed
from the merged records (:func:`~tract_async.loadtest.report.resummarize`).

What it refuses: parts whose workloads differ (another seed, prompt lengths, request count...:
their requests would not be the same requests), and a system present in two parts. What it
keeps visible: each system's part and machine; when the parts ran on different hosts the
summary says so, since figures compare only within one host.
"""
from __future__ import annotations

import json
import os
from typing import Any

#: The options that define which requests a run sends: equal in every part of a merge.
WORKLOAD_ARGS: tuple[str, ...] = (
    "seed", "model", "dtype", "block_tokens", "workload_list", "requests", "input_len",
    "length_scale", "output_len", "group_size", "burstiness", "sweep_list", "ttft_slo_ms")


class MergeError(ValueError):
    """The parts cannot be merged; the message says which part and which option."""


def _load_part(path: str) -> tuple[dict[str, Any], dict[tuple[str, int], list[dict[str, Any]]]]:
    try:
        with open(os.path.join(path, "results.json")) as f:
            report = json.load(f)
        records: dict[tuple[str, int], list[dict[str, Any]]] = {}
        with open(os.path.join(path, "records.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                records.setdefault((r["system"], r["phase"]), []).append(r)
    except FileNotFoundError as exc:
        raise MergeError(f"{path} is not a finished run of the load benchmark: {exc}") from None
    return report, records


def merge_runs(parts: list[str], out_dir: str) -> dict[str, Any]:
    """Merge the runs in ``parts`` into ``out_dir`` (created; it must not hold a run already)
    and return the recomputed report.

    Raises:
        MergeError: fewer than two parts, a part that is not a finished run, workload options
            that differ, a system in two parts, or ``out_dir`` already holding results.
    """
    from tract_async.loadtest.report import resummarize
    if len(parts) < 2:
        raise MergeError(f"--merge takes two or more run directories, got {len(parts)}")
    if os.path.exists(os.path.join(out_dir, "results.json")):
        raise MergeError(f"{out_dir} already holds a run: merge into a new directory")
    loaded = [(p, *_load_part(p)) for p in parts]
    first_path, first, _ = loaded[0]
    for path, report, _ in loaded[1:]:
        for key in WORKLOAD_ARGS:
            a, b = first["args"].get(key), report["args"].get(key)
            if a != b:
                raise MergeError(f"{path} ran another workload than {first_path}: "
                                 f"{key} = {b!r} there, {a!r} here")
    merged: dict[str, Any] = {**first, "systems": {}, "status": "ok",
                              "label": f"{first.get('label', '')}; merged from {len(parts)} parts",
                              "parts": []}
    merged.pop("resummarized", None)
    owner: dict[str, str] = {}
    lines: list[str] = []
    for i, (path, report, records) in enumerate(loaded):
        m = report.get("machine", {})
        merged["parts"].append({"dir": os.path.abspath(path), "status": report.get("status"),
                                "systems": sorted(report["systems"]),
                                "machine": {k: m.get(k) for k in ("hostname", "gpu", "cpu",
                                                                   "git", "date")}})
        if report.get("status") != "ok":
            merged["status"] = "partial"
        for name, entry in report["systems"].items():
            if name in owner:
                raise MergeError(f"system {name!r} is in {owner[name]} and in {path}: take "
                                 f"each system from one part")
            owner[name] = path
            entry = {**entry, "part": i}
            for p in entry.get("phases", []):
                for r in records.get((name, p["phase"]), []):
                    lines.append(json.dumps(r, default=str))
            merged["systems"][name] = entry
    hosts = {(p["machine"].get("hostname"), p["machine"].get("gpu")) for p in merged["parts"]}
    merged["parts_same_host"] = len(hosts) == 1
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(merged, f, indent=1, default=str)
    with open(os.path.join(out_dir, "records.jsonl"), "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return resummarize(out_dir)


__all__ = ["MergeError", "WORKLOAD_ARGS", "merge_runs"]
