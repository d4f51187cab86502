"""Where a serving run's prefill lost time between layers: the computing thread or the loop.

    python bench/layer_gaps.py RUN_DIR [RUN_DIR ...]     # a `tract bench serve` output folder
                                                           # (or its .tgz), run with TRACT_PHASES=1

For each request that streamed layers, from its ``records.jsonl`` events: the gap from layer 0's
put being enqueued to layer 1's store beginning (``enqueued_L0`` -> ``store_begin_L1``), split
into the computing thread's part (``computed_L0`` -> ``computed_L1``: the compute of layer 0's
attention and MLP and layer 1's projections, as the host issues it) and the loop's part
(``computed_L1`` -> ``store_begin_L1``), beside the median of the same gaps over layers 1-30;
and the loop stalls (``lag#i``) and CUDA allocator calls (``cuda_*``) the timeline names.
Records without ``computed_L*`` (runs before 34f3117) show the whole gap only. Prints a table
per run and a summary: how many requests lost over 20 ms there, and where.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tarfile
import tempfile


def _records(run: pathlib.Path) -> list[dict]:
    if run.suffix == ".tgz" or run.name.endswith(".tar.gz"):
        tmp = pathlib.Path(tempfile.mkdtemp())
        with tarfile.open(run) as tf:
            tf.extractall(tmp, filter="data")
        found = sorted(tmp.rglob("records.jsonl"))
        if not found:
            sys.exit(f"{run}: no records.jsonl inside")
        run = found[0].parent
    path = run / "records.jsonl" if run.is_dir() else run
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gaps(rec: dict) -> dict | None:
    ev = rec.get("events_ms") or {}
    if "store_begin_L1" not in ev or "enqueued_L0" not in ev:
        return None
    n = 0
    while f"store_begin_L{n + 1}" in ev and f"enqueued_L{n}" in ev:
        n += 1
    later = [ev[f"store_begin_L{i + 1}"] - ev[f"enqueued_L{i}"] for i in range(1, n)]
    out = {"system": rec.get("system"), "load": rec.get("load"), "index": rec.get("index"),
           "prompt_tokens": rec.get("prompt_tokens"), "hit_blocks": rec.get("hit_blocks"),
           "gap01_ms": ev["store_begin_L1"] - ev["enqueued_L0"],
           "later_median_ms": statistics.median(later) if later else None,
           "thread01_ms": None, "loop01_ms": None,
           "lags": sum(1 for k in ev if k.startswith("lag#") and not k.endswith("_end")),
           "cuda": [k for k in ev if k.startswith("cuda_")]}
    if "computed_L1" in ev and "computed_L0" in ev:
        out["thread01_ms"] = ev["computed_L1"] - ev["computed_L0"]
        out["loop01_ms"] = ev["store_begin_L1"] - ev["computed_L1"]
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=pathlib.Path)
    p.add_argument("--over-ms", type=float, default=20.0, help="a gap counted as a stall")
    a = p.parse_args(argv)
    for run in a.runs:
        rows = [g for g in map(gaps, _records(run)) if g is not None]
        print(f"\n## {run}\n")
        print("| system | load | # | prompt | hit blocks | L0->L1 gap ms | thread | loop "
              "| later layers' median | loop stalls | CUDA allocator |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for g in rows:
            print(f"| {g['system']} | {g['load']} | {g['index']} | {g['prompt_tokens']} | "
                  f"{g['hit_blocks']} | {_f(g['gap01_ms'])} | {_f(g['thread01_ms'])} | "
                  f"{_f(g['loop01_ms'])} | {_f(g['later_median_ms'])} | {g['lags']} | "
                  f"{' '.join(g['cuda']) or '-'} |")
        slow = [g for g in rows if g["gap01_ms"] > a.over_ms]
        thread = [g for g in slow if g["thread01_ms"] is not None
                  and g["thread01_ms"] >= 0.9 * g["gap01_ms"]]
        print(f"\n{len(slow)} of {len(rows)} requests lost over {a.over_ms:g} ms between layers "
              f"0 and 1 (median {_f(statistics.median([g['gap01_ms'] for g in slow]) if slow else None)} ms, "
              f"max {_f(max((g['gap01_ms'] for g in slow), default=None))} ms); "
              f"{len(thread)} of them in the computing thread"
              + ("" if any(g["thread01_ms"] is not None for g in rows)
                 else " (no computed_L stamps in this run)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
