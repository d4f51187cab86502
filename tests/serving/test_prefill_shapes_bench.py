"""bench/prefill_shapes.py and bench/layer_gaps.py run on the CPU (their --smoke / a synthetic
record), so that the GPU session that needs them does not find them broken."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_prefill_shapes_smoke_writes_a_row_per_pass_and_length(tmp_path: pathlib.Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_shapes.py"), "--smoke",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (out,) = tmp_path.glob("prefill-shapes-*.json")
    rows = json.loads(out.read_text())["rows"]
    # default, no-cudnn, default again: 3 lengths + 1 hit each
    assert [r["backend"] for r in rows] == ["default"] * 4 + ["no-cudnn"] * 4 + ["default"] * 4
    assert all(r["gap01_first_ms"] > 0 and r["total_second_ms"] > 0 for r in rows)
    assert len({r["tokens"] for r in rows if r["hit"] == 0}) == 9     # fresh lengths a pass


def test_layer_gaps_splits_the_gap_into_thread_and_loop(tmp_path: pathlib.Path) -> None:
    ev = {"enqueued_L0": 10.0, "computed_L0": 5.0, "computed_L1": 60.0, "store_begin_L1": 61.0,
          "enqueued_L1": 62.0, "computed_L2": 64.0, "store_begin_L2": 65.0, "enqueued_L2": 66.0,
          "store_begin_L3": 68.0, "lag#0": 1.0, "lag#0_end": 9.0}
    rec = {"system": "region-transfer", "load": "4 clients", "index": 0, "prompt_tokens": 4000,
           "hit_blocks": 0, "events_ms": ev}
    (tmp_path / "records.jsonl").write_text(json.dumps(rec) + "\n")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "layer_gaps.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("| region-transfer"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5:10] == ["51.0", "55.0", "1.0", "2.5", "1"], cells
    assert "1 of 1 requests lost over 20 ms" in r.stdout and "1 of them in the computing thread" in r.stdout
