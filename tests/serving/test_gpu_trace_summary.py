"""bench/gpu_trace.py's reading of a profiler trace, on a synthetic one (the tool itself needs
a GPU): the GPU session that runs it should not find its summary broken.

The trace holds what torch.profiler's Chrome export holds: host marks (``user_annotation``),
copies (``gpu_memcpy``) and kernels with device times on the host's clock, and cudart calls
with their thread. Every figure the summary gives is checked against the events."""
from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _x(cat: str, name: str, ts: float, dur: float, **kw) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **kw}


def _trace(tmp_path: pathlib.Path) -> str:
    evs = [
        # a whole put: start 0-300 (its mark), copies 200-1200 and 1250-2200, await until 2300
        _x("user_annotation", "whole_put_1", 0, 2300),
        _x("user_annotation", "start_put", 0, 300),
        _x("cuda_runtime", "cudaMemcpy2DAsync", 190, 6, tid=7),
        _x("cuda_runtime", "cudaMemcpy2DAsync", 240, 4, tid=7),
        _x("gpu_memcpy", "Memcpy DtoH", 200, 1000, args={"bytes": 50_000_000}),
        _x("gpu_memcpy", "Memcpy DtoH", 1250, 950, args={"bytes": 50_000_000}),
        # a warm-up rep: left out
        _x("user_annotation", "whole_put_warm", 5000, 100),
        # a prefill: kernels 10000-10400 and 10450-10900 (a 50 us gap), 2 launches
        _x("user_annotation", "prefill_started_512_1", 10_000, 1000),
        _x("kernel", "gemm", 10_000, 400),
        _x("kernel", "attn", 10_450, 450),
        _x("cuda_runtime", "cudaLaunchKernel", 10_002, 8, tid=1),
        _x("cuda_runtime", "cudaLaunchKernel", 10_100, 12, tid=1),
        _x("cuda_runtime", "cudaEventQuery", 10_200, 2, tid=2),
    ]
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": evs}))
    return str(p)


def test_the_summary_reads_a_trace(tmp_path: pathlib.Path) -> None:
    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_trace as T
        # the tool took bench/ off the path itself (bench/kernels.py shadows the `kernels`
        # package that transformers probes for: a later import of transformers in this process
        # failed while it stayed)
        assert str(ROOT / "bench") not in sys.path
    finally:
        sys.path[:] = saved
    s = T.summarize(T.Trace(_trace(tmp_path)))
    w = s["whole_put"]
    assert len(w["rows"]) == 1                         # the warm-up rep left out
    assert w["pre_us_med"] == 200 and w["span_us_med"] == 2000 and w["busy_us_med"] == 1950
    assert w["tail_us_med"] == 100 and w["start_us_med"] == 300 and w["copies_med"] == 2
    assert abs(w["gbs_med"] - 100e6 / 2000 / 1e3) < 1e-9
    assert w["rows"][0]["start_calls"]["cudaMemcpy2DAsync"] == {"n": 2, "us": 10}
    p = s["prefill_started_512"]
    assert p["kernel_busy_ms_med"] == 0.85 and p["kernel_span_ms_med"] == 0.9
    assert p["gap_sum_ms_med"] == 0.05 and p["gaps_over_20us_med"] == 1
    assert p["launches_med"] == 2 and p["launch_us_mean_med"] == 10
    row = p["rows"][0]
    assert row["threads"]["2"]["cudaEventQuery"]["n"] == 1
    T.show(s)                                          # prints without failing
