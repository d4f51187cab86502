"""The CUDA path's CPU-visible behaviour: importing and engine hooks on a CPU-only torch, the
telemetry no-op, stats flags, and the Triton copy kernel run by Triton's interpreter (when
triton is installed)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tract_async as tract
from tract_async.cuda import NvmlSampler
from tract_async.errors import TensorMismatch

LAYOUT = tract.KVLayout(num_layers=2, block_tokens=4, kv_heads=2, head_dim=8, dtype=torch.float16)


def _cfg(path):
    return tract.EngineConfig(region=path, region_bytes=16 << 20, create=True, layout=LAYOUT,
                              chunk_bytes=1 << 16)


def test_import_makes_no_cuda_call():
    code = ("import torch, tract_async, tract_async.cuda.api, tract_async.cuda.store, "
            "tract_async.cuda.copy, tract_async.cuda.pipeline; "
            "assert not torch.cuda.is_initialized(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
async def test_cpu_engine_reports_no_cuda_and_refuses_cuda_reads(region_path):
    async with tract.Engine.open(_cfg(region_path)) as eng:
        assert eng.stats()["cuda"] is None
        keys = eng.block_keys(list(range(8)))
        kv = torch.randn(LAYOUT.kv_shape(2)).to(LAYOUT.dtype)
        assert await eng.put_kv(keys, kv) == 2            # the CPU path is untouched
        assert torch.equal(await eng.get_kv(keys), kv)
        with pytest.raises(TensorMismatch, match="not available"):
            await eng.get_kv(keys, device="cuda")
        with pytest.raises(TensorMismatch, match="not available"):
            await eng.start_get_kv(keys, device="cuda")
        assert eng.stats()["cuda"] is None                # nothing was registered


async def test_telemetry_is_a_noop_without_nvml_and_stops_with_the_engine(region_path):
    eng = await tract.Engine.open(_cfg(region_path))
    try:
        s = eng.start_telemetry(interval_s=0.01)
        assert eng.start_telemetry() is s                 # started once
        await asyncio.sleep(0.05)
        st = eng.stats()["cuda"]
        assert st["telemetry"]["available"] == s.available
        if not s.available:
            assert s.series()["t_s"] == [] and s.reason
        task = eng._cuda_ops._cuda.sampler_task
        assert task is not None and not task.done()
    finally:
        await eng.close()
    assert task.done()                                     # owned by the engine: stopped


def test_sampler_series_and_marks_without_nvml(monkeypatch):
    import tract_async.cuda.telemetry as tel
    monkeypatch.setattr(tel, "_load_nvml", lambda: (None, "forced off"))
    s = NvmlSampler(0, interval_s=0.01)
    assert not s.available and s.sample_once() is None
    s.mark("put-0")
    assert s.marks[0][1] == "put-0" and s.summary()["reason"] == "forced off"
    with pytest.raises(ValueError):
        NvmlSampler(0, interval_s=0)


def test_sampler_with_a_fake_nvml_keeps_bounded_series(monkeypatch):
    import tract_async.cuda.telemetry as tel

    class FakeNvml:
        NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetPcieThroughput(self, h, which):
            return 55_000_000 if which == 0 else 1_000      # KB/s

        def nvmlDeviceGetUtilizationRates(self, h):
            return type("U", (), {"gpu": 97, "memory": 40})()

        def nvmlDeviceGetMemoryInfo(self, h):
            return type("M", (), {"used": 3 << 30})()

        def nvmlDeviceGetPowerUsage(self, h):
            return 450_000                                  # mW

    monkeypatch.setattr(tel, "_load_nvml", lambda: (FakeNvml(), ""))
    s = NvmlSampler(0, interval_s=0.01, max_samples=3)
    for _ in range(5):
        s.sample_once()
    ser = s.series()
    assert len(ser["t_s"]) == 3
    assert ser["pcie_tx_mbs"][-1] == 55_000 and ser["pcie_rx_mbs"][-1] == 1
    assert ser["power_w"][-1] == 450 and ser["mem_used_mib"][-1] == 3072
    assert s.summary()["sm_util_pct_max"] == 97


_INTERP = textwrap.dedent("""
    import os, torch, numpy as np
    os.environ["TRITON_INTERPRET"] = "1"
    from tract_async.cuda import triton_copy as tc
    assert tc.available()[0], tc.available()
    src = torch.arange(4096, dtype=torch.int32)            # 16 KiB: rows of 256 bytes
    dst = torch.zeros(4096, dtype=torch.int32)
    rb = 256
    rows = [(3, 0), (0, 5), (7, 2), (63, 63)]              # (src row, dst row)
    tbl = torch.tensor([[s * rb // 16, d * rb // 16] for s, d in rows], dtype=torch.int64)
    tc.copy_rows(src, dst, tbl, rb)
    w = rb // 4
    want = torch.zeros_like(dst)
    for s, d in rows:
        want[d * w:(d + 1) * w] = src[s * w:(s + 1) * w]
    assert torch.equal(dst, want), "rows differ"
    assert tc.block_words(256) == 64 and tc.block_words(32768) == 4096 and tc.block_words(48) == 4
    print("interp-ok")
""")


def test_triton_row_copy_kernel_under_the_interpreter():
    """The zero-copy kernel's address arithmetic, run by Triton's CPU interpreter (a separate
    process: TRITON_INTERPRET must be set before the kernel is defined)."""
    extra = os.environ.get("TRACT_TRITON_PATH", "")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (extra, os.getcwd(),
                                                      os.environ.get("PYTHONPATH", "")) if p))
    probe = subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True)
    if probe.returncode != 0:
        pytest.skip("triton is not installed (set TRACT_TRITON_PATH to a directory holding it)")
    r = subprocess.run([sys.executable, "-c", _INTERP], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "interp-ok" in r.stdout, r.stdout + r.stderr


async def test_put_ready_follows_the_task_and_reaches_no_other() -> None:
    """``cuda.store.put_ready``: the event a CUDA put waits for instead of the current stream
    (the prefill worker's fix for DMAs that waited for later layers) is seen inside the
    context, across awaits, and by no task started outside it."""
    import asyncio

    from tract_async.cuda import store as cs
    marker = object()
    seen: dict[str, object] = {}

    async def other() -> None:
        await asyncio.sleep(0.01)
        seen["other"] = cs._PUT_READY.get()

    t = asyncio.ensure_future(other())
    with cs.put_ready(marker):
        await asyncio.sleep(0)
        seen["inside"] = cs._PUT_READY.get()
        await t
    seen["after"] = cs._PUT_READY.get()
    assert seen == {"inside": marker, "other": None, "after": None}


def test_engine_delegates_every_public_cuda_method_with_its_signature():
    """The CUDA API is a part the Engine owns (``cuda.api.CudaOps``), not a mixin: each public
    method of it is an Engine method with the same signature and docstring."""
    import inspect

    import tract_async as tract
    from tract_async.cuda.api import CudaOps
    internal = {"path", "stats", "teardown", "put_cuda", "get_cuda", "put_timeout"}
    public = sorted(n for n, v in vars(CudaOps).items()
                    if callable(v) and not n.startswith("_") and n not in internal)
    assert public == sorted(["cuda_setup", "start_put_kv", "start_get_kv", "start_put_kv_paged",
                             "put_kv_paged", "start_get_kv_paged", "get_kv_paged",
                             "start_telemetry", "stop_telemetry"])
    assert CudaOps not in tract.Engine.__mro__
    for name in public:
        mine, theirs = getattr(tract.Engine, name), getattr(CudaOps, name)
        assert inspect.signature(mine) == inspect.signature(theirs), name
        assert mine.__doc__ == theirs.__doc__ and mine.__doc__, name
        assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(theirs), name
