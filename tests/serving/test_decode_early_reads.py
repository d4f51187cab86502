"""A request that waits for the decode worker's compute slot reads its KV while it waits.

Real router, prefill and decode processes on a real /dev/shm region (region-transfer mode). A
first request holds the decode worker's compute slot for a long generation; a second one, sent
once the first has streamed its first token, must have every layer of its KV in hand before it
gets the slot (``DecodeWorker.EARLY_READS``): otherwise its whole transfer starts when the slot
frees and sits on its TTFT (the H100 serving run of 2026-12-06). Outputs are checked against
the same model run in this process.
"""
from __future__ import annotations

import asyncio
import glob
import importlib.util

import aiohttp
import pytest

from tract_async.serving.launcher import Rack
from tract_async.serving.workload import complete_streaming

T = 16
EOS = 257
LAYERS = 4
# tokens of the first request: its decode holds the slot meanwhile. 120 held it too briefly on
# a loaded VM (three xdist workers): the slot came free at 69.8 ms, before the second request's
# last layer landed (82.3 ms), and the test's premise, not the property, failed
LONG = 240
SHORT = 6


@pytest.fixture(scope="module")
def model():
    from tract_async.serving.model import build_model, tiny_llama_config
    return build_model(tiny_llama_config(num_layers=LAYERS), seed=0)


def long_prompt(model) -> tuple[list[int], list[int]]:
    """A 3-block prompt whose greedy continuation runs LONG tokens without the EOS (searched
    over a few deterministic candidates: the model has random weights)."""
    from tract_async.serving.model import reference_generate
    for k in range(1, 40):
        prompt = [256] + [(k * 13 + 5 * i) % 250 for i in range(3 * T - 1)]
        out = reference_generate(model, prompt, LONG, eos_token_id=EOS)
        if len(out) == LONG:
            return prompt, out
    pytest.fail("no candidate prompt decodes LONG tokens without the EOS")


async def serve_together(rack: Rack, model, prompts: list[list[int]], max_tokens: int):
    """Every prompt at once through ``rack`` (started and stopped here), each answer checked
    against the reference; returns the answers and the decode worker's health after them."""
    from tract_async.serving.model import reference_generate
    async with rack, aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(complete_streaming(session, rack.router_url, p,
                                                            max_tokens) for p in prompts))
        async with session.get(f"{rack.url_of('decode')}/health") as r:
            health = await r.json()
    for p, (tokens, _, _) in zip(prompts, results):
        assert tokens == reference_generate(model, p, max_tokens, eos_token_id=EOS)
    return results, health


@pytest.mark.parametrize("first_pass", ["stream", "extend"])
async def test_a_waiting_request_holds_its_kv_before_it_gets_the_compute_slot(
        model, region_path, tmp_path, first_pass) -> None:
    from tract_async.serving.model import reference_generate
    first, first_ref = long_prompt(model)
    second = [256] + [(11 * i + 3) % 250 for i in range(4 * T - 1)]
    rack = Rack(mode="region-transfer", region=region_path, log_dir=str(tmp_path), seed=0,
                block_tokens=T, region_bytes=64 << 20, torch_threads=1, layer_timeout_s=60.0,
                first_pass=first_pass)
    async with rack, aiohttp.ClientSession() as session:
        url = rack.router_url
        started = asyncio.Event()
        got: list[int] = []
        body = {"prompt": first, "max_tokens": LONG, "stream": True, "temperature": 0}

        async def hold_the_slot() -> None:
            import orjson
            async with session.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    msg = orjson.loads(line[6:])
                    got.extend(msg["choices"][0].get("token_ids", []))
                    started.set()

        holder = asyncio.create_task(hold_the_slot())
        await asyncio.wait_for(started.wait(), 60)
        assert not holder.done(), "the first request ended before the second one was sent"
        tokens, _, tract = await complete_streaming(session, url, second, SHORT)
        await holder
        assert got == first_ref
        assert tokens == reference_generate(model, second, SHORT, eos_token_id=EOS)
        ev = tract["events_ms"]
        assert "early_reads" in ev, sorted(ev)
        dcs = ev["decode_compute_start"]
        gots = [ev[f"got_L{i}"] for i in range(LAYERS)]
        assert max(gots) <= dcs, (gots, dcs)   # every layer in hand before the slot
        assert ev["early_reads"] <= min(gots)
        assert all(f"ask_L{i}" in ev for i in range(LAYERS))
    assert all(sp.proc.returncode == 0 for sp in rack.services)
    assert not glob.glob(region_path + "*")


async def test_concurrent_requests_share_decode_steps(model, region_path, tmp_path) -> None:
    """The decode worker batches (ServiceConfig.decode_batch): requests that generate at the
    same time run in shared steps, and each still gets exactly the reference's tokens."""
    prompts = [[256] + [(k * 7 + 3 * i) % 250 for i in range((2 + k) * T - 1)] for k in range(3)]
    rack = Rack(mode="region-transfer", region=region_path, log_dir=str(tmp_path), seed=0,
                block_tokens=T, region_bytes=64 << 20, torch_threads=1, layer_timeout_s=60.0)
    results, health = await serve_together(rack, model, prompts, 80)
    batch = health["batch"]
    assert batch["max_batch"] == 8 and batch["max_seen_batch"] >= 2, batch
    total = sum(len(t) for t, _, _ in results)
    assert batch["steps"] < total - len(prompts), batch   # fewer steps than tokens: shared
    assert all(sp.proc.returncode == 0 for sp in rack.services)
    assert not glob.glob(region_path + "*")


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
async def test_a_nixl_prefill_waits_for_room_in_its_pool(model, tmp_path) -> None:
    """The nixl prefill puts a request's KV into its engine's pool, where it stays until the
    decode worker reads it. The decode worker reads a request's whole KV only once it holds one
    of its reader slots (``decode_batch + early_reads``: one here), so that no more requests
    than that hold their KV at once (unbounded, a nixl decode worker ran out of GPU memory);
    with a pool that holds two requests' KV, the third and fourth concurrent prefills then find
    the pool full: they wait for room (``PrefillWorker._put_when_room``) and every request
    completes, where the prefill answered 500 (RegionFull) before (both on the H100 at 4.2
    req/s: bench/results/gpu-20261207-s50, call 3)."""
    from tract_async.serving.model import kv_layout_for
    geo = kv_layout_for(model.config, T)
    block_bytes = geo.num_layers * 2 * T * geo.kv_heads * geo.head_dim * \
        model.lm_head.weight.element_size()
    prompts = [[256] + [(k * 11 + 3 * i) % 250 for i in range(3 * T - 1)] for k in range(4)]
    rack = Rack(mode="nixl", region=None, log_dir=str(tmp_path), seed=0, block_tokens=T,
                torch_threads=1, layer_timeout_s=60.0, kv_pool_bytes=7 * block_bytes,
                role_options={"decode": {"decode_batch": 1, "early_reads": 0}})
    # 120 tokens: the first request's decode holds the one reader slot while the other three
    # prefill; with 40, a loaded CI worker once prefilled so slowly that the second request was
    # read before the fourth's put, and no prefill found the pool full (the premise below)
    results, health = await serve_together(rack, model, prompts, 120)
    held = health["kv_holders"]
    assert held == {"max": 1, "limit": 1}, held
    waited = [tract["events_ms"] for _, _, tract in results if "kv_store_full" in tract["events_ms"]]
    assert waited, "no prefill found the pool full: the test's premise did not hold"
    assert all(sp.proc.returncode == 0 for sp in rack.services)
