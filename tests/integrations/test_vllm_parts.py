"""The vLLM connector's parts that need no vLLM: the loop bridge, the page conversion, the
settings, and the error a missing vLLM gives. These run in the project's CI venv too."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="the vLLM connector's page conversion needs torch")

import tract_async as tract  # noqa: E402
from tract_async.integrations.vllm.bridge import LoopThread  # noqa: E402
from tract_async.integrations.vllm.pages import (check_page_view, gather_layer,  # noqa: E402
                                                 scatter_layer)
from tract_async.integrations.vllm.settings import ConnectorSettings  # noqa: E402

LAYOUT = tract.KVLayout(num_layers=2, block_tokens=4, kv_heads=3, head_dim=5,
                        dtype=torch.bfloat16)


def bhnc_view(nb: int, order: tuple[int, ...]) -> torch.Tensor:
    """A logical [B, H, N, C] view whose memory is laid out in ``order`` (as vLLM's
    ``VLLM_KV_CACHE_LAYOUT`` permutes it): e.g. (0, 2, 1, 3) is [B, N, H, C] in memory."""
    shape = (nb, LAYOUT.kv_heads, LAYOUT.block_tokens, 2 * LAYOUT.head_dim)
    phys = torch.empty([shape[i] for i in order], dtype=LAYOUT.dtype)
    inv = [order.index(i) for i in range(4)]
    return phys.permute(*inv)


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3)], ids=["BHNC", "BNHC"])
def test_pages_round_trip_bit_exact_and_in_the_engine_layout(order: tuple[int, ...]) -> None:
    src = bhnc_view(10, order)
    src.copy_(torch.randn(src.shape).to(LAYOUT.dtype))
    check_page_view(src, LAYOUT, "layer0")
    ids = torch.tensor([7, 2, 5], dtype=torch.int64)
    kv = gather_layer(src, ids, LAYOUT)
    assert kv.shape == LAYOUT.kv_shape(3, 0) and kv.is_contiguous()
    d, t = LAYOUT.head_dim, LAYOUT.block_tokens
    # the engine's layout: kv[0] is K, kv[1] is V, token-major; block i holds rows i*T..
    assert torch.equal(kv[0, 1 * t + 2, 1], src[2, 1, 2, :d])
    assert torch.equal(kv[1, 2 * t + 3, 2], src[5, 2, 3, d:])
    dst = bhnc_view(10, (0, 2, 1, 3) if order == (0, 1, 2, 3) else (0, 1, 2, 3))
    dst.zero_()
    scatter_layer(dst, torch.tensor([0, 9, 4]), kv, LAYOUT)
    for a, b in ((7, 0), (2, 9), (5, 4)):
        assert torch.equal(dst[b], src[a])           # bit-exact, across physical layouts
    assert not dst[1].any() and not dst[8].any()     # nothing else written


def test_page_view_mismatch_names_the_difference() -> None:
    with pytest.raises(ValueError, match=r"\[B, H, N, C\].*C=2\*5"):
        check_page_view(torch.zeros(4, 3, 4, 5, dtype=LAYOUT.dtype), LAYOUT, "l0")
    with pytest.raises(ValueError, match="dtype torch.float16"):
        check_page_view(torch.zeros(4, 3, 4, 10, dtype=torch.float16), LAYOUT, "l0")


def test_settings() -> None:
    s = ConnectorSettings.from_extra({"region": "/dev/shm/x", "node_id": 2})
    assert s.resolved_mode("kv_both") == "cache"
    assert s.resolved_mode("kv_producer") == s.resolved_mode("kv_consumer") == "transfer"
    assert ConnectorSettings.from_extra({"region": "r", "mode": "cache"}).resolved_mode(
        "kv_consumer") == "cache"
    with pytest.raises(ValueError, match="needs \"region\""):
        ConnectorSettings.from_extra({})
    with pytest.raises(ValueError, match="unknown keys \\['nodeid'\\]"):
        ConnectorSettings.from_extra({"region": "r", "nodeid": 1})
    with pytest.raises(ValueError, match="\"mode\""):
        ConnectorSettings.from_extra({"region": "r", "mode": "both"})


def test_loop_thread_runs_the_engine_for_plain_threads(region_path: str) -> None:
    """A plain thread drives a real engine on the loop thread: submit returns at once, the
    result comes through a Future (no polling), and the engine's background tasks keep running
    between calls (the heartbeat would otherwise lapse)."""
    lt = LoopThread("tract-test-loop")
    try:
        layout = tract.KVLayout(num_layers=2, block_tokens=4, kv_heads=2, head_dim=8,
                                dtype=torch.float16)
        cfg = tract.EngineConfig(region=region_path, region_bytes=16 << 20, create=True,
                                 remove_on_close=True, node_id=0, layout=layout)
        eng = lt.call(_open(cfg), timeout=300)
        keys = eng.block_keys(list(range(8)))
        kv = torch.randn(layout.kv_shape(len(keys), 0)).to(torch.float16)
        gate = threading.Event()

        async def gated_put() -> int:
            await asyncio.get_running_loop().run_in_executor(None, gate.wait)
            return await eng.put_kv(keys, kv, layer=0)

        t0 = time.monotonic()
        fut = lt.submit(gated_put())
        assert time.monotonic() - t0 < 0.5 and not fut.done()   # submit does not wait
        gate.set()
        assert fut.result(timeout=30) == 2
        time.sleep(3 * cfg.liveness_timeout_s)                 # idle: the loop keeps beating
        out = lt.call(eng.get_kv(keys, layer=0), timeout=30)
        assert torch.equal(out, kv)
        with pytest.raises(RuntimeError, match="deadlock"):
            lt.loop.call_soon_threadsafe(lambda: None)
            lt.submit(_call_from_loop(lt)).result(timeout=10)
        lt.call(eng.close(), timeout=60)
    finally:
        lt.stop()
        lt.stop()                                              # idempotent
    assert not lt.alive
    with pytest.raises(RuntimeError, match="stopped"):
        lt.submit(asyncio.sleep(0))


async def _open(cfg: tract.EngineConfig) -> tract.Engine:
    return await tract.Engine.open(cfg)


async def _call_from_loop(lt: LoopThread) -> None:
    lt.call(asyncio.sleep(0))


def test_missing_vllm_names_the_extra() -> None:
    """Without vLLM the package still imports (the core install walks every module), and the
    connector names the extra to install."""
    code = ("import sys\nsys.modules['vllm'] = None\n"
            "import tract_async.integrations.vllm as m\n"
            "from tract_async.errors import MissingExtra\n"
            "try:\n    m.TractConnector\nexcept MissingExtra as e:\n    print('OK', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("OK") and "pip install 'tract-async[vllm]'" in res.stdout
