"""Per-service Prometheus metrics: separate registries, the promised series, and /metrics."""
from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tract_async.serving.metrics import LOCK_WAIT_BUCKETS, TTFT_BUCKETS, ServiceMetrics, metrics_handler


def _samples(metrics: ServiceMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.exposition()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_two_services_in_one_process_do_not_collide():
    prefill = ServiceMetrics("prefill-0", role="prefill", node_id=0)
    decode = ServiceMetrics("decode-0", role="decode", node_id=1)
    prefill.observe_ttft(0.004)
    prefill.count_request()
    decode.count_request("error")
    p, d = _samples(prefill), _samples(decode)
    assert p[("tract_ttft_seconds_count", ())] == 1
    assert d[("tract_ttft_seconds_count", ())] == 0
    assert p[("tract_requests_total", (("outcome", "ok"),))] == 1
    assert d[("tract_requests_total", (("outcome", "error"),))] == 1
    assert p[("tract_service_info", (("node_id", "0"), ("role", "prefill"), ("service", "prefill-0")))] == 1
    # nothing leaked into the process-global registry
    assert REGISTRY.get_sample_value("tract_requests_total", {"outcome": "ok"}) is None


def test_every_series_records_what_it_is_given():
    m = ServiceMetrics("svc")
    for seconds in (0.0015, 0.03, 3.0):
        m.observe_ttft(seconds)
    m.add_prefix_hit_blocks(5)
    m.add_prefix_hit_blocks(0)
    m.add_bytes_moved(2 << 20, transport="region", direction="put")
    m.add_bytes_moved(4096, transport="http", direction="get")
    m.observe_lock_wait(3e-5)
    s = _samples(m)
    assert s[("tract_ttft_seconds_bucket", (("le", "0.002"),))] == 1
    assert s[("tract_ttft_seconds_bucket", (("le", "0.05"),))] == 2
    assert s[("tract_ttft_seconds_bucket", (("le", "10.0"),))] == 3
    assert s[("tract_ttft_seconds_sum", ())] == pytest.approx(3.0315)
    assert s[("tract_prefix_hit_blocks_total", ())] == 5
    assert s[("tract_bytes_moved_total", (("direction", "put"), ("transport", "region")))] == 2 << 20
    assert s[("tract_bytes_moved_total", (("direction", "get"), ("transport", "http")))] == 4096
    assert s[("tract_lock_wait_seconds_bucket", (("le", "5e-05"),))] == 1
    # all outcomes are exported from the start, at zero
    assert s[("tract_requests_total", (("outcome", "cancelled"),))] == 0


def test_buckets_cover_the_promised_ranges():
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 10.0
    assert list(TTFT_BUCKETS) == sorted(TTFT_BUCKETS)
    assert LOCK_WAIT_BUCKETS[0] <= 1e-5 and LOCK_WAIT_BUCKETS[-1] >= 1.0


def test_bad_values_are_refused():
    m = ServiceMetrics("svc")
    with pytest.raises(ValueError):
        m.observe_ttft(-0.1)
    with pytest.raises(ValueError):
        m.observe_lock_wait(-1)
    with pytest.raises(ValueError):
        m.count_request("weird")
    with pytest.raises(ValueError):
        m.add_bytes_moved(-1)
    with pytest.raises(ValueError):
        m.add_prefix_hit_blocks(-2)
    assert _samples(m)[("tract_ttft_seconds_count", ())] == 0


async def test_metrics_endpoint_serves_text_and_openmetrics():
    m = ServiceMetrics("router")
    m.observe_ttft(0.01)
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(m))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port=0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                text = await resp.text()
            headers = {"Accept": "application/openmetrics-text; version=1.0.0"}
            async with session.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as resp:
                assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
                assert (await resp.text()).rstrip().endswith("# EOF")
    finally:
        await runner.cleanup()
    assert "tract_ttft_seconds_count 1.0" in text
