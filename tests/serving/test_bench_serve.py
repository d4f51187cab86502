"""``tract bench serve``: the command line, and the smoke size run for real (CI).

The smoke run is deliberately not marked ``slow``: ``.ci/run`` (``-m "not slow"``) runs it, so
every commit starts every system's rack, sends real requests through the real router, and checks
outcomes, never timings: every system has a row or a reason, every request completed, every TTFT
is positive, and the prefix cache hit on the chat workload. About a minute on 2 cores (five
racks of three processes start one after the other).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tract_async.cli import build_parser
from tract_async.loadtest.runner import SYSTEM_NAMES, loads, resolve_args

# issue 37: one xdist worker runs these racks of processes one after another (two at once on
# two cores starved a decode service past its 10 s SIGTERM grace)
pytestmark = pytest.mark.xdist_group("racks")


def test_bench_serve_is_a_cli_subcommand_that_passes_its_options_on():
    args = build_parser().parse_args(["bench", "serve", "--size", "cpu", "--rates", "1,2",
                                      "--systems=http,region-cache", "-h"])
    assert args.bench_args == ["--size", "cpu", "--rates", "1,2", "--systems=http,region-cache", "-h"]
    assert callable(args.func)


def test_presets_fill_what_is_left_unset_and_bad_input_is_refused(capsys):
    a = resolve_args(["--size", "cpu", "--rates", "1,inf", "--output-len", "3"])
    assert a.rate_list == [1.0, math.inf] and a.output_len == 3 and a.concurrency_list == [4]
    assert loads(a, "chat") == [("open", 1.0), ("open", math.inf), ("closed", 4.0)]
    assert loads(a, "rag") == [("open", 1.0)]      # only chat is swept at the cpu size
    assert (a.min_input_tokens, a.max_input_tokens) == (32, 512)   # 512-8192 scaled by 1/16
    assert a.workload_list == ["chat", "rag", "agentic", "unique"]
    h = resolve_args(["--size", "h200"])
    assert (h.model, h.device, h.min_input_tokens, h.max_input_tokens) == ("llama3-8b", "cuda", 512, 8192)
    for bad in (["--systems", "carrier-pigeon"], ["--workloads", "poetry"], ["--rates", "fast"],
                ["--rates", "", "--concurrency", ""], ["--rates", "-1"], ["--sweep", "poetry"]):
        with pytest.raises(SystemExit):
            resolve_args(bad)
    assert "carrier-pigeon" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_smoke_size_runs_every_system_and_reports_real_outcomes(tmp_path):
    out = tmp_path / "out"
    before = {f for f in os.listdir("/dev/shm") if f.startswith("tract-bench-")}
    order = list(reversed(SYSTEM_NAMES))     # run in the order given, not the canonical one
    proc = subprocess.run([sys.executable, "-m", "tract_async.cli", "bench", "serve", "--size",
                           "smoke", "--systems", ",".join(order), "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    records: dict[str, list[dict]] = {}
    for line in (out / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        records.setdefault(r["system"], []).append(r)
    assert report["status"] == "ok" and report["seed"] == 0
    assert report["machine"]["versions"]["torch"] and report["args"]["size"] == "smoke"
    assert list(report["systems"]) == order
    ran = [json.loads(line)["system"] for line in (out / "records.jsonl").read_text().splitlines()]
    assert list(dict.fromkeys(ran)) == [s for s in order if s in ran]
    for name, entry in report["systems"].items():
        if entry["status"] != "ok":        # absent (nixl here) or failed: it must say why
            assert entry["status"] == "absent" and "nixl" in entry["reason"], (name, entry)
            continue
        [phase] = entry["phases"]
        s = phase["summary"]
        assert s["completed"] == s["requests"] == 8, (name, s["errors"])
        assert len(records[name]) == 8
        ttfts = [r["first_token_s"] - r["sent_s"] for r in records[name]]
        assert all(t > 0 for t in ttfts) and s["ttft_p99_ms"] >= s["ttft_p50_ms"] > 0
        assert all(r["output_tokens"] == 4 and r["error"] is None for r in records[name])
        assert s["throughput_rps"] > 0 and s["ideal_hit_rate"] > 0.3
        if name == "region-cache":
            assert s["hit_rate"] > 0 and s["hit_blocks"] <= s["ideal_hit_rate"] * s["full_blocks"] + 1e-9
        else:
            assert s["hit_rate"] == 0
        if name == "recompute":
            assert s["kv_bytes"] == 0
        else:
            assert s["kv_bytes"] > 0
    assert report["telemetry"]["available"] or report["telemetry"]["reason"]
    # greedy outputs do not depend on how the KV travelled (issue 38)
    assert report["outputs"]["compared"] == 8 and report["outputs"]["differ"] == [], \
        report["outputs"]
    assert all(len(r["output_ids"]) == 4 for rs in records.values() for r in rs)
    md = (out / "summary.md").read_text()
    assert "Greedy outputs: 8 of 8 requests" in md
    assert all(f"| {n} |" in md or f"`{n}`" in md for n in SYSTEM_NAMES)
    for png in ("ttft_cdf.png", "hit_rate.png", "breakdown.png"):
        assert (out / png).stat().st_size > 1000
    # the run left no region behind (compared with the listing before it: a CompletedProcess
    # has no pid to match names against, and other runs' leftovers are not this one's)
    assert not {f for f in os.listdir("/dev/shm") if f.startswith("tract-bench-")} - before
