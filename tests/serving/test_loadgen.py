"""The load benchmark's harness itself, without the serving stack: seeded workloads, arrival
processes, the streaming client and both loops (against an in-process stand-in of the router),
and every metric on a hand-made trace whose values are computed by hand below."""
from __future__ import annotations

import asyncio
import io
import json
import math

import numpy as np
import orjson
import pytest
from aiohttp import web

from tract_async.loadtest.generator import (Progress, RequestRecord, arrival_times,
                                         interarrival_gaps, run_closed_loop, run_open_loop)
from tract_async.loadtest.stats import breakdown_ms, summarize
from tract_async.loadtest.workloads import (WORKLOADS, LoadRequest, Vocab, WorkloadSpec,
                                           build_requests, ideal_hit_blocks, ideal_hit_rate)

T = 16


# --- workloads ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", WORKLOADS)
def test_same_seed_same_ids_other_seed_other_ids(kind):
    spec = WorkloadSpec(kind=kind, requests=12, seed=5, min_input_tokens=64, max_input_tokens=512,
                        output_tokens=4)
    a, b = build_requests(spec), build_requests(spec)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    other = build_requests(WorkloadSpec(**{**spec.__dict__, "seed": 6}))
    assert all(x.prompt_ids != y.prompt_ids for x, y in zip(a, other))
    assert len(a) == 12 and [r.index for r in a] == list(range(12))
    assert all(64 <= len(r.prompt_ids) <= 512 and r.max_tokens == 4 for r in a)
    assert all(r.prompt_ids[0] == 256 and max(r.prompt_ids[1:]) < 256 for r in a)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_two_phases_share_no_block(kind):
    """A second phase (another rate) must not hit what the first stored."""
    base = dict(kind=kind, requests=8, seed=1, min_input_tokens=64, max_input_tokens=256)
    p0 = build_requests(WorkloadSpec(**base, phase=0))
    p1 = build_requests(WorkloadSpec(**base, phase=1))
    hits = ideal_hit_blocks([r.prompt_ids for r in p0 + p1], T)
    assert hits[len(p0)] == 0 and sum(hits[len(p0):]) == sum(ideal_hit_blocks(
        [r.prompt_ids for r in p1], T))


def test_known_reuse_per_workload():
    def rate(kind):
        return ideal_hit_rate(build_requests(WorkloadSpec(kind=kind, requests=16, min_input_tokens=64,
                                                          max_input_tokens=512)), T)
    assert rate("unique") == 0.0
    assert rate("chat") > 0.5 and rate("rag") > 0.5 and rate("agentic") > 0.3


def test_chat_history_grows_and_keeps_its_prefix():
    reqs = build_requests(WorkloadSpec(kind="chat", requests=8, group_size=4, min_input_tokens=64,
                                       max_input_tokens=256))
    # interleaved: c0t0 c1t0 c0t1 c1t1 ...
    assert [(r.group, r.step) for r in reqs] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
                                                 (0, 3), (1, 3)]
    c0 = [r.prompt_ids for r in reqs if r.group == 0]
    assert [len(p) for p in c0] == [64, 128, 192, 256]
    assert all(later[:len(earlier)] == earlier for earlier, later in zip(c0, c0[1:]))
    sys_len = 64 - 16   # the first user message: a quarter of the shortest prompt
    assert reqs[0].prompt_ids[:sys_len] == reqs[1].prompt_ids[:sys_len]
    assert reqs[0].prompt_ids[sys_len:] != reqs[1].prompt_ids[sys_len:]


def test_llama3_vocab():
    reqs = build_requests(WorkloadSpec(kind="unique", requests=3, vocab=Vocab.for_model("llama3-8b")))
    assert all(r.prompt_ids[0] == 128000 and 512 <= len(r.prompt_ids) <= 8192 for r in reqs)


def test_ideal_hit_blocks_by_hand():
    a = list(range(40))                  # blocks A0 A1 (+8 tokens)
    b = list(range(32)) + [99] * 16      # A0 A1 B2
    c = [7] + list(range(1, 48))         # C0 ... : differs in the first token, no hit
    d = list(range(16)) + [5] * 16       # A0 D1: a partial prefix hit
    assert ideal_hit_blocks([a, b, c, d, b], T) == [0, 2, 0, 1, 3]


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec(kind="poetry", requests=1)
    with pytest.raises(ValueError, match="min_input_tokens"):
        WorkloadSpec(kind="chat", requests=1, min_input_tokens=600, max_input_tokens=500)
    with pytest.raises(ValueError, match="grows"):
        build_requests(WorkloadSpec(kind="chat", requests=4, min_input_tokens=64, max_input_tokens=65))


# --- arrivals ----------------------------------------------------------------------------------
def _ks_exponential(gaps: np.ndarray, rate: float) -> float:
    """Kolmogorov-Smirnov distance between the gaps and Exp(rate)."""
    x = np.sort(gaps)
    n = len(x)
    cdf = 1.0 - np.exp(-rate * x)
    return float(max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n)))


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_arrivals_have_the_rate_and_the_shape(rate):
    n = 20_000
    gaps = interarrival_gaps(n, rate, seed=11)
    assert abs(gaps.mean() * rate - 1.0) < 0.03          # mean gap within 3 % of 1 / rate
    assert abs(gaps.std() * rate - 1.0) < 0.05           # exponential: std == mean
    critical = 1.63 / math.sqrt(n)                       # KS, alpha = 0.01
    assert _ks_exponential(gaps, rate) < critical
    # negative control: evenly spread gaps of the same mean fail the same check
    even = np.random.default_rng(3).uniform(0, 2 / rate, size=n)
    assert abs(even.mean() * rate - 1.0) < 0.03 and _ks_exponential(even, rate) > critical


def test_gamma_arrivals_keep_the_mean_and_change_the_spread():
    bursty = interarrival_gaps(20_000, 2.0, seed=1, burstiness=0.5)
    smooth = interarrival_gaps(20_000, 2.0, seed=1, burstiness=4.0)
    assert abs(bursty.mean() * 2 - 1) < 0.03 and abs(smooth.mean() * 2 - 1) < 0.03
    assert bursty.std() * 2 > 1.3 and smooth.std() * 2 < 0.6    # cv = 1 / sqrt(shape)


def test_arrival_times():
    t = arrival_times(5, 2.0, seed=0)
    assert t[0] == 0.0 and len(t) == 5 and np.all(np.diff(t) > 0)
    assert np.array_equal(t, arrival_times(5, 2.0, seed=0))
    assert not np.array_equal(t, arrival_times(5, 2.0, seed=1))
    assert np.array_equal(arrival_times(4, math.inf, seed=0), np.zeros(4))
    with pytest.raises(ValueError):
        interarrival_gaps(3, 0.0, seed=0)


# --- metrics on a hand-made trace -----------------------------------------------------------------
def _rec(i, sent, tokens, *, prompt, hit, full, end=None, error=None):
    r = RequestRecord(index=i, workload="chat", group=0, step=i, prompt_tokens=prompt, max_tokens=8,
                      scheduled_s=sent, sent_s=sent, hit_blocks=hit, full_blocks=full)
    if tokens:
        r.first_token_s, r.token_times_s, r.output_tokens = tokens[0], list(tokens), len(tokens)
    r.end_s = end if end is not None else (tokens[-1] + 0.001)
    r.error = error
    return r


def test_summary_equals_hand_computed_values():
    recs = [
        _rec(0, 0.0, [0.010, 0.020, 0.030], prompt=100, hit=2, full=6),
        _rec(1, 0.1, [0.120, 0.150], prompt=200, hit=0, full=12),
        _rec(2, 0.2, [0.230], prompt=50, hit=3, full=3),
        _rec(3, 0.3, [0.34, 0.35, 0.36, 0.37, 0.38], prompt=80, hit=1, full=5, end=0.5),
        _rec(4, 0.4, [0.5, 0.6], prompt=70, hit=0, full=4, end=0.6),
        _rec(5, 0.45, [], prompt=60, hit=0, full=4, end=0.46, error="HTTP 503: full"),
    ]
    s = summarize(recs, ttft_slo_ms=35.0)
    ap = pytest.approx
    assert (s["requests"], s["completed"], s["failed"]) == (6, 5, 1)
    assert s["errors"] == ["HTTP 503: full"]
    # TTFT 10, 20, 30, 40, 100 ms; p90 at rank 3.6: 40 + 0.6 * 60; p99 at 3.96: 40 + 0.96 * 60
    assert s["ttft_mean_ms"] == ap(40.0) and s["ttft_p50_ms"] == ap(30.0)
    assert s["ttft_p90_ms"] == ap(76.0) and s["ttft_p99_ms"] == ap(97.6)
    # TPOT 20/2, 30/1, (none: one token), 40/4, 100/1 ms -> [10, 10, 30, 100]
    assert s["tpot_mean_ms"] == ap(37.5) and s["tpot_p50_ms"] == ap(20.0)
    assert s["tpot_p99_ms"] == ap(30 + 0.97 * 70)
    # first send 0.0 s, last end 0.6 s
    assert s["duration_s"] == ap(0.6)
    assert s["throughput_rps"] == ap(5 / 0.6) and s["output_tok_s"] == ap(13 / 0.6)
    assert s["input_tok_s"] == ap(500 / 0.6)
    # TTFT <= 35 ms: three requests; attainment over all six
    assert s["goodput_rps"] == ap(3 / 0.6) and s["slo_attainment"] == ap(0.5)
    assert s["hit_rate"] == ap(6 / 30) and (s["hit_blocks"], s["full_blocks"]) == (6, 30)


def test_summary_of_nothing_is_nan_not_an_error():
    s = summarize([], ttft_slo_ms=100.0)
    assert s["completed"] == 0 and math.isnan(s["ttft_mean_ms"]) and math.isnan(s["throughput_rps"])


def test_breakdown_of_each_transport_by_hand():
    http = {"prefill_recv": 1.0, "prefill_compute_start": 3.0, "store_begin_L0": 5.0, "put_L0": 5.5,
            "store_begin_L1": 8.0, "put_L1": 8.25, "prefill_done": 9.0, "decode_recv": 10.0,
            "http_read_done": 14.0, "decode_compute_start": 15.0, "got_L0": 15.5, "got_L1": 16.0,
            "first_token": 19.0}
    assert breakdown_ms(http, router_ttft_ms=19.5) == {
        "queue": 2.0 + 1.0, "prefix_load": 0.0, "prefill_compute": 6.0, "kv_store": 0.75,
        "kv_load": 4.0, "first_decode_step": 4.0, "token_delivery": 0.5}
    streamed = {"prefill_recv": 1.0, "lookup_done": 1.5, "hit_read": 2.5, "prefill_compute_start": 4.0,
                "decode_recv": 1.0, "decode_compute_start": 1.2, "store_begin_L0": 6.0, "put_L0": 7.0,
                "got_L0": 7.2, "store_begin_L1": 9.0, "put_L1": 10.0, "got_L1": 10.5,
                "prefill_done": 10.1, "first_token": 12.0}
    assert breakdown_ms(streamed) == pytest.approx(
        {"queue": 1.5, "prefix_load": 1.0, "prefill_compute": 6.1, "kv_store": 2.0, "kv_load": 0.5,
         "first_decode_step": 1.5, "token_delivery": 0.0})
    # the same, but decode got its compute slot only after the KV was complete (at 10.0):
    # 1.0 more of queue, and the hop counts from the slot
    late = {**streamed, "decode_compute_start": 11.0, "got_L0": 11.3, "got_L1": 11.8,
            "first_token": 13.0}
    assert breakdown_ms(late) == pytest.approx(
        {"queue": 1.5 + 1.0, "prefix_load": 1.0, "prefill_compute": 6.1, "kv_store": 2.0,
         "kv_load": 0.8, "first_decode_step": 1.2, "token_delivery": 0.0})
    # read early (from 1.1, before any slot): every layer in hand at 10.5, the slot only at
    # 14.0: the last layer's hop (10.0 -> 10.5) is kv_load, the wait for the slot once the KV
    # was in hand (10.5 -> 14.0) is queue, and the first step runs from the slot. (A decode
    # worker whose first pass starts only after every layer arrived, first_pass=extend, always
    # looks like this: before, its hop was counted as queue and kv_load read 0.)
    early = {**streamed, "early_reads": 1.1, "decode_compute_start": 14.0, "first_token": 15.5}
    assert breakdown_ms(early) == pytest.approx(
        {"queue": 1.5 + 3.5, "prefix_load": 1.0, "prefill_compute": 6.1, "kv_store": 2.0,
         "kv_load": 0.5, "first_decode_step": 1.5, "token_delivery": 0.0})
    # read early and the first pass right after the last layer (no wait for a slot)
    at_once = {**early, "decode_compute_start": 10.6, "first_token": 12.0}
    assert breakdown_ms(at_once) == pytest.approx(
        {"queue": 1.5 + 0.1, "prefix_load": 1.0, "prefill_compute": 6.1, "kv_store": 2.0,
         "kv_load": 0.5, "first_decode_step": 1.4, "token_delivery": 0.0})
    modelled = {"prefill_recv": 1.0, "prefill_compute_start": 1.0, "prefill_done": 5.0,
                "decode_recv": 6.0, "kv_load_begin": 6.0, "kv_model_due": 6.5, "kv_load_done": 6.6,
                "decode_compute_start": 6.6, "got_L0": 6.7, "first_token": 8.7}
    assert breakdown_ms(modelled) == pytest.approx(
        {"queue": 0.0, "prefix_load": 0.0, "prefill_compute": 4.0, "kv_store": 0.0, "kv_load": 0.6,
         "first_decode_step": 2.1, "token_delivery": 0.0})
    # nixl: every layer stored once after the compute, then one get of all of them
    whole = {"prefill_recv": 1.0, "prefill_compute_start": 1.0, "kv_store_begin": 4.0,
             "kv_store_done": 4.75, "prefill_done": 5.0, "decode_recv": 6.0, "kv_load_begin": 6.0,
             "kv_load_done": 9.0, "decode_compute_start": 9.0, "got_L0": 9.1, "first_token": 10.0}
    assert breakdown_ms(whole) == pytest.approx(
        {"queue": 0.0, "prefix_load": 0.0, "prefill_compute": 4.0, "kv_store": 0.75,
         "kv_load": 3.0, "first_decode_step": 1.0, "token_delivery": 0.0})
    recompute = {"decode_recv": 0.5, "decode_compute_start": 1.0, "first_token": 30.0}
    assert breakdown_ms(recompute) == pytest.approx(
        {"queue": 0.5, "prefix_load": 0.0, "prefill_compute": 0.0, "kv_store": 0.0, "kv_load": 0.0,
         "first_decode_step": 29.0, "token_delivery": 0.0})


def test_progress_prints_plain_lines_when_not_a_tty():
    out = io.StringIO()
    p = Progress("chat @ 2/s", 2, stream=out, line_every_s=1e9)
    recs = [_rec(0, 0.0, [0.01], prompt=10, hit=0, full=0), _rec(1, 0.0, [], prompt=10, hit=0,
                                                                  full=0, end=0.1, error="x")]
    for r in recs:
        p.start(r)
    p.finish(recs[0])
    assert out.getvalue() == ""            # not yet: no time passed, not the last one
    p.finish(recs[1])
    p.close()
    assert out.getvalue() == "chat @ 2/s: 2/2 done, 0 in flight, 1 errors, TTFT p50 10.0 ms\n"


# --- the client and the loops against an in-process stand-in of the router ------------------------
class FakeRouter:
    """Streams ``max_tokens`` chunks ``delay_s`` apart, then a final chunk with a ``tract``
    report, like the router; counts requests in flight. The first ``hold`` requests are held
    until all ``hold`` have arrived, so that "were they in flight together" does not depend on
    how fast a loaded machine runs the test (nothing here is timed)."""

    def __init__(self, delay_s: float, hold: int) -> None:
        self.delay_s = delay_s
        self.hold = hold
        self.all_held = asyncio.Event()
        self.in_flight = self.peak = 0
        self.arrived: list[float] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.arrived.append(asyncio.get_running_loop().time())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if len(self.arrived) >= self.hold:
            self.all_held.set()
        try:
            if len(self.arrived) <= self.hold:
                async with asyncio.timeout(30):   # a client that serializes fails, not hangs
                    await self.all_held.wait()
            if body["prompt"][1] == 13:
                return web.json_response({"error": {"message": "KV pool full"}}, status=503)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.delay_s)
                chunk = {"choices": [{"token_ids": [i]}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            last = {"choices": [{"token_ids": []}], "tract": {
                "ttft_ms": 1.5, "hit_blocks": 2, "full_blocks": len(body["prompt"]) // T,
                "kv_bytes": 4096, "events_ms": {"prefill_recv": 0.1, "first_token": 1.4}}}
            await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture
async def fake_router():
    fake = FakeRouter(delay_s=0.02, hold=3)
    app = web.Application()
    app.router.add_post("/v1/completions", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _reqs(n, *, bad=()):
    return [LoadRequest(index=i, workload="unique", group=i, step=0, max_tokens=3,
                        prompt_ids=(256, 13 if i in bad else 1) + (2,) * 46) for i in range(n)]


async def test_closed_loop_keeps_n_in_flight_and_records_everything(fake_router):
    fake, url = fake_router
    recs = await run_closed_loop(url, _reqs(9, bad={4}), 3)
    assert fake.peak == 3 and len(fake.arrived) == 9
    ok = [r for r in recs if r.ok]
    assert len(ok) == 8 and recs[4].error.startswith("HTTP 503")
    for r in ok:
        assert r.output_tokens == 3 and r.hit_blocks == 2 and r.full_blocks == 3
        assert len(r.output_ids) == 3
        assert r.kv_bytes == 4096 and r.router_ttft_ms == 1.5 and r.events_ms["first_token"] == 1.4
        assert 0 < r.ttft_s < r.e2e_s and r.tpot_s > 0.015
    assert not math.isnan(recs[4].end_s)


async def test_open_loop_sends_on_schedule_whatever_is_in_flight(fake_router):
    fake, url = fake_router
    arrivals = [0.0, 0.0, 0.0, 0.15]
    recs = await run_open_loop(url, _reqs(4), arrivals)
    # the three of t = 0 were in flight together: none waited for another (the fourth may
    # find them still there on a slow host: 3 or 4, never fewer)
    assert all(r.ok for r in recs) and fake.peak >= 3
    assert [r.scheduled_s for r in recs] == arrivals
    assert all(r.sent_s >= r.scheduled_s for r in recs)  # never early (late is reported)
    with pytest.raises(ValueError):
        await run_open_loop(url, _reqs(2), [0.1, 0.0])


def test_resummarize_recomputes_a_run_from_its_records(tmp_path):
    """A finished run's metrics come back from records.jsonl alone (no server)."""
    from tract_async.loadtest.report import resummarize
    from tract_async.loadtest.report import machine_info
    recs = [_rec(0, 0.0, [0.010, 0.020], prompt=100, hit=2, full=6),
            _rec(1, 0.1, [0.190, 0.200], prompt=200, hit=0, full=12)]
    phase = {"phase": 1, "workload": "chat", "loop": "open", "value": 8.0, "label": "8 req/s",
             "summary": {"ideal_hit_rate": 0.25, "wall_s": 1.0, "ttft_mean_ms": -1.0},
             "engine": {}}
    report = {"bench": "serve_load", "machine": machine_info(), "seed": 0, "status": "ok",
              "args": {"ttft_slo_ms": 50.0}, "systems": {"http": {"status": "ok",
                                                                   "phases": [phase]}}}
    (tmp_path / "results.json").write_text(orjson.dumps(report).decode())
    (tmp_path / "records.jsonl").write_text("".join(
        orjson.dumps({"system": "http", "phase": 1, "load": "8 req/s", **r.to_json()}).decode()
        + "\n" for r in recs))
    out = resummarize(str(tmp_path))
    s = out["systems"]["http"]["phases"][0]["summary"]
    assert s["ttft_mean_ms"] == pytest.approx(50.0) and s["ideal_hit_rate"] == 0.25
    assert s["goodput_rps"] == pytest.approx(1 / 0.201) and s["hit_rate"] == pytest.approx(2 / 18)
    assert "| http | chat | 8 req/s | 2/2 | 50.0 |" in (tmp_path / "summary.md").read_text()
    # Python's json (NaN stays NaN, as in the repo's other result files)
    assert json.loads((tmp_path / "results.json").read_text())["resummarized"]["git"]


def test_output_agreement_compares_requests_across_systems():
    from tract_async.loadtest.report import output_agreement

    def phase(outputs: list[list[int] | None]) -> dict:
        recs = []
        for i, ids in enumerate(outputs):
            r = _rec(i, 0.0, [0.01, 0.02], prompt=10, hit=0, full=1).to_json()
            r.update(output_ids=ids or [], error=None if ids else "boom")
            recs.append(r)
        return {"phase": 1, "workload": "chat", "label": "1 req/s", "records": recs}
    report = {"systems": {"a": {"phases": [phase([[1, 2], [3, 4], [5], None])]},
                          "b": {"phases": [phase([[1, 2], [3, 5], [5], [7]])]},
                          "c": {"phases": [phase([[1, 2], [3, 4], None, None])]}}}
    got = output_agreement(report)
    # request 3 was served by b alone: not compared; request 1 differs in b
    assert got["compared"] == 3 and got["agree"] == 2
    assert got["differ"] == [{"workload": "chat", "load": "1 req/s", "index": 1,
                              "reference": "a", "differ": ["b"]}]
    assert output_agreement({"systems": {}}) == {"compared": 0, "agree": 0, "differ": []}


def _write_run(path, systems: list[str], *, seed: int = 0, host: str = "h1") -> None:
    from tract_async.loadtest.report import machine_info
    path.mkdir()
    machine = {**machine_info(), "hostname": host}
    report = {"bench": "serve_load", "machine": machine, "seed": seed, "status": "ok",
              "label": "test", "args": {"ttft_slo_ms": 50.0, "seed": seed, "requests": 2},
              "systems": {}}
    lines = []
    for k, name in enumerate(systems):
        report["systems"][name] = {"status": "ok", "phases": [
            {"phase": 1, "workload": "chat", "loop": "open", "value": 8.0, "label": "8 req/s",
             "summary": {"ideal_hit_rate": 0.25, "wall_s": 1.0}, "engine": {}}]}
        for r in (_rec(0, 0.0, [0.010 * (k + 1), 0.020 * (k + 1)], prompt=100, hit=0, full=6),
                  _rec(1, 0.1, [0.19, 0.2], prompt=200, hit=0, full=12)):
            d = {"system": name, "phase": 1, "load": "8 req/s", **r.to_json(),
                 "output_ids": [1, 2]}
            lines.append(orjson.dumps(d).decode() + "\n")
    (path / "results.json").write_text(orjson.dumps(report).decode())
    (path / "records.jsonl").write_text("".join(lines))


def test_merge_makes_one_report_of_parts_and_refuses_what_does_not_fit(tmp_path):
    from tract_async.loadtest.runner import main
    from tract_async.loadtest.merge import MergeError, merge_runs
    _write_run(tmp_path / "a", ["http", "rdma-model"], host="h1")
    _write_run(tmp_path / "b", ["region-transfer"], host="h2")
    out = merge_runs([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))
    assert sorted(out["systems"]) == ["http", "rdma-model", "region-transfer"]
    assert out["systems"]["region-transfer"]["part"] == 1 and not out["parts_same_host"]
    s = out["systems"]["rdma-model"]["phases"][0]["summary"]
    assert s["ttft_mean_ms"] == pytest.approx((20.0 + 90.0) / 2)    # recomputed from records
    md = (tmp_path / "m" / "summary.md").read_text()
    assert "Merged from 2 runs" in md and "different hosts" in md
    assert "| region-transfer | chat | 8 req/s | 2/2 |" in md
    assert "Greedy outputs: 2 of 2 requests" in md
    assert len((tmp_path / "m" / "records.jsonl").read_text().splitlines()) == 6
    with pytest.raises(MergeError, match="already holds a run"):
        merge_runs([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))
    _write_run(tmp_path / "c", ["http"])
    with pytest.raises(MergeError, match="'http' is in"):
        merge_runs([str(tmp_path / "a"), str(tmp_path / "c")], str(tmp_path / "m2"))
    _write_run(tmp_path / "d", ["recompute"], seed=1)
    with pytest.raises(MergeError, match="seed = 1 there, 0 here"):
        merge_runs([str(tmp_path / "a"), str(tmp_path / "d")], str(tmp_path / "m3"))
    with pytest.raises(MergeError, match="not a finished run"):
        merge_runs([str(tmp_path / "a"), str(tmp_path / "nope")], str(tmp_path / "m4"))
    with pytest.raises(MergeError, match="two or more"):
        merge_runs([str(tmp_path / "a")], str(tmp_path / "m5"))
    # the command line: 0 on a merge, 2 with the reason on a refusal
    assert main(["--merge", str(tmp_path / "b"), str(tmp_path / "c"),
                 "--out-dir", str(tmp_path / "m6")]) == 0
    assert main(["--merge", str(tmp_path / "a"), str(tmp_path / "c"),
                 "--out-dir", str(tmp_path / "m7")]) == 2


# --- the one SSE reader (serving/workload.completion_messages) through both clients, and the
# --- budget of a load run (loadtest/runner.within_budget) ---------------------------------------
@pytest.fixture
async def sse_server():
    """``/v1/completions`` streams one token, then: ``cut`` (prompt[1] == 1) ends without
    ``[DONE]``, ``error`` (2) sends an in-band error event, anything else ``[DONE]``."""
    async def handle(request: web.Request) -> web.StreamResponse:
        kind = orjson.loads(await request.read())["prompt"][1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": a comment line\n\ndata: " + orjson.dumps(
            {"choices": [{"token_ids": [7]}], "tract": {"ttft_ms": 2.0}}) + b"\n\n")
        if kind == 2:
            await resp.write(b'data: {"error": {"message": "decode died"}}\n\n')
        elif kind != 1:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_both_clients_read_the_stream_alike(sse_server):
    import aiohttp
    from tract_async.serving.errors import UpstreamFailed
    from tract_async.serving.workload import StreamCutShort, complete_streaming
    url = sse_server
    async with aiohttp.ClientSession() as s:
        tokens, ttft_s, tract = await complete_streaming(s, url, [256, 0, 3], 4)
        assert tokens == [7] and tract == {"ttft_ms": 2.0} and ttft_s > 0
        with pytest.raises(StreamCutShort, match=r"without data: \[DONE\]"):
            await complete_streaming(s, url, [256, 1, 3], 4)
        with pytest.raises(UpstreamFailed, match="decode died"):
            await complete_streaming(s, url, [256, 2, 3], 4)
    recs = await run_closed_loop(url, [
        LoadRequest(index=i, workload="unique", group=i, step=0, max_tokens=4,
                    prompt_ids=(256, i, 3)) for i in range(3)], 1)
    assert recs[0].ok and recs[0].output_ids == [7] and recs[0].router_ttft_ms == 2.0
    assert recs[1].error == "the stream ended without data: [DONE]"
    assert recs[2].error.startswith("in-band error") and "decode died" in recs[2].error
    assert all(not math.isnan(r.end_s) for r in recs)


async def test_a_load_run_ends_by_its_work_its_budget_or_a_signal():
    import os
    import signal
    from tract_async.loadtest.runner import within_budget
    report: dict = {}
    await within_budget(lambda: asyncio.sleep(0), 5, report)
    assert report["status"] == "ok"
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
    await within_budget(forever, 0.05, report)
    assert report["status"] == "budget of 0.05 s exhausted" and cancelled.is_set()

    async def interrupt_me() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(3600)
    # a task of its own: the SIGINT cancels the task that runs the load, as in `tract bench`
    await asyncio.create_task(within_budget(interrupt_me, 60, report))
    assert report["status"] == "interrupted"
    # its handlers are gone afterwards: SIGINT is Python's KeyboardInterrupt again
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(RuntimeError):
        await within_budget(_raise_runtime_error, 5, report)


async def _raise_runtime_error() -> None:
    raise RuntimeError("not the budget's business")
