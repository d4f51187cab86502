"""ServiceConfig's GIL knobs: a worker's engine does not spin on its loop, and the worker
process bounds how long a thread waits for the GIL (``ServiceConfig``'s docstring says why).
And what a worker checks of its configuration before it builds its model."""
from __future__ import annotations

import asyncio
import sys

import pytest

from tract_async.serving.errors import ServiceConfigError
from tract_async.serving.service import ServiceConfig, engine_config, serve


def test_worker_engines_do_not_spin_by_default_and_the_flag_reaches_the_engine(tmp_path) -> None:
    import torch

    import tract_async as tract
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=8,
                            dtype=torch.float32)
    cfg = ServiceConfig(role="decode", mode="region-transfer", region=str(tmp_path / "r"))
    assert engine_config(cfg, layout).wait_spin_us == 0
    cfg = ServiceConfig(role="decode", mode="region-transfer", region=str(tmp_path / "r"),
                        wait_spin_us=150)
    assert engine_config(cfg, layout).wait_spin_us == 150


@pytest.mark.parametrize("bad", [{"wait_spin_us": -1}, {"switch_interval_us": 0.0},
                                 {"switch_interval_us": -5.0}])
def test_bad_gil_knobs_are_refused(bad) -> None:
    with pytest.raises(ServiceConfigError):
        ServiceConfig(role="prefill", mode="recompute", **bad)


async def test_serve_sets_the_switch_interval() -> None:
    from aiohttp import web
    before = sys.getswitchinterval()
    stop = asyncio.Event()
    stop.set()                       # serve starts, prints its ready line, and stops at once
    cfg = ServiceConfig(role="prefill", mode="recompute", switch_interval_us=750.0)
    try:
        await serve(web.Application(), cfg, stop=stop)
        assert sys.getswitchinterval() == pytest.approx(750e-6)
    finally:
        sys.setswitchinterval(before)


def test_decode_early_reads_default_and_bound() -> None:
    from tract_async.serving.decode_worker import DecodeWorker
    assert ServiceConfig(role="decode", mode="recompute").early_reads == DecodeWorker.EARLY_READS
    with pytest.raises(ServiceConfigError):
        ServiceConfig(role="decode", mode="recompute", early_reads=-1)


def test_load_benchmark_service_options_reach_the_racks() -> None:
    from tract_async.loadtest.runner import resolve_args, service_options
    opts = service_options(["decode:early_reads=1", "wait_spin_us=150",
                            "switch_interval_us=250.5", "prefill:die_with_parent=true"])
    assert opts == {"wait_spin_us": 150, "switch_interval_us": 250.5,
                    "role_options": {"decode": {"early_reads": 1},
                                     "prefill": {"die_with_parent": True}}}
    for bad in (["early_reads"], ["nosuch=1"], ["decode:early_reads=lots"], ["mode=http"],
                ["gpu:early_reads=1"]):
        with pytest.raises(ValueError):
            service_options(bad)
    with pytest.raises(SystemExit):
        resolve_args(["--size", "smoke", "--service-opt", "nosuch=1"])
    args = resolve_args(["--size", "smoke", "--service-opt", "decode:early_reads=0"])
    assert args.service_opt == ["decode:early_reads=0"]


@pytest.mark.parametrize("bad", [{"attn": "flash"}, {"decode_batch": -1}, {"decode_max_len": 1},
                                 {"first_pass": "eager"}])
def test_bad_model_and_batch_options_are_refused(bad) -> None:
    with pytest.raises(ServiceConfigError):
        ServiceConfig(role="decode", mode="recompute", **bad)


def test_attention_is_sdpa_on_cuda_and_eager_on_the_cpu() -> None:
    from tract_async.serving.service import attn_implementation
    assert attn_implementation(ServiceConfig(role="decode", mode="recompute")) == "eager"
    assert attn_implementation(ServiceConfig(role="decode", mode="recompute",
                                             device="cuda:0")) == "sdpa"
    assert attn_implementation(ServiceConfig(role="decode", mode="recompute", device="cuda",
                                             attn="eager")) == "eager"


def test_nixl_pool_follows_the_model_device_unless_set(tmp_path) -> None:
    """A GPU nixl worker keeps its pool in GPU memory (the paper's NIXL baseline moves VRAM);
    the option overrides it; other network modes and bad values are refused or unaffected."""
    import torch

    import tract_async as tract
    from tract_async.serving.service import kv_pool_device
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=8,
                            dtype=torch.float32)
    assert kv_pool_device(ServiceConfig(role="prefill", mode="nixl", device="cuda:1")) == "cuda:1"
    assert kv_pool_device(ServiceConfig(role="prefill", mode="nixl", device="cpu")) == "cpu"
    assert kv_pool_device(ServiceConfig(role="prefill", mode="nixl", device="cuda",
                                        kv_pool_device="cpu")) == "cpu"
    cfg = ServiceConfig(role="prefill", mode="nixl")
    assert engine_config(cfg, layout).nixl_pool_device == "cpu"
    with pytest.raises(ServiceConfigError):
        ServiceConfig(role="prefill", mode="nixl", kv_pool_device="tpu")


def test_nixl_progress_thread_auto_follows_the_cores(monkeypatch) -> None:
    """NIXL's spinning progress thread: on with 8 cores or more unless set; refused values."""
    import os

    from tract_async.serving.service import nixl_progress_thread
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert nixl_progress_thread(ServiceConfig(role="prefill", mode="nixl")) is True
    assert nixl_progress_thread(ServiceConfig(role="prefill", mode="nixl",
                                              nixl_progress_thread="off")) is False
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert nixl_progress_thread(ServiceConfig(role="prefill", mode="nixl")) is False
    assert nixl_progress_thread(ServiceConfig(role="prefill", mode="nixl",
                                              nixl_progress_thread="on")) is True
    with pytest.raises(ServiceConfigError):
        ServiceConfig(role="prefill", mode="nixl", nixl_progress_thread="maybe")



@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_region_in_a_missing_directory_fails_before_the_model_is_built(
        tmp_path, monkeypatch, role: str) -> None:  # noqa: ANN001
    """A worker that is to create its region in a directory that does not exist says so at
    once, in ``Engine.open``'s words, instead of after building its model (the failed starts of
    tests/serving/test_zygote.py spent 7-10 CPU-s each on the model first)."""
    from tract_async.errors import RegionNotFound
    from tract_async.serving import decode_worker, prefill_worker
    mod = prefill_worker if role == "prefill" else decode_worker
    built: list[object] = []
    monkeypatch.setattr(mod, "load_model", lambda cfg: built.append(cfg))
    region = str(tmp_path / "no-such-dir" / "region")
    cfg = ServiceConfig(role=role, mode="region-transfer", node_id=0 if role == "prefill" else 1,
                        create_region=True, region=region)
    app = mod.build_app(cfg)
    res = (prefill_worker._resources if role == "prefill" else decode_worker._resources)(app)
    with pytest.raises(RegionNotFound, match=r"directory .*no-such-dir does not exist"):
        await res.__anext__()
    assert built == []
    assert not (tmp_path / "no-such-dir").exists()


def test_check_creatable_passes_an_existing_directory_and_creates_nothing(tmp_path) -> None:  # noqa: ANN001
    from tract_async.errors import RegionNotFound
    from tract_async.region.region import check_creatable
    check_creatable(str(tmp_path / "region"))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RegionNotFound, match="create it first"):
        check_creatable(str(tmp_path / "a" / "b" / "region"))
