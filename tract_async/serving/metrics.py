"""Prometheus metrics of one serving process (prefill worker, decode worker, router).

Each :class:`ServiceMetrics` owns its own ``CollectorRegistry`` rather than the global default:
the demo and the tests run several services in one process, and on the global registry the second
service's metric names would collide with the first's (prometheus_client raises on duplicates).
A service exposes its registry on ``GET /metrics`` with :func:`metrics_handler`.

Buckets: TTFT spans a warm prefix hit on a tiny CPU model (about a millisecond) to a cold 8B
prefill of a long prompt (seconds), so its buckets run 1 ms .. 10 s in 1-2-5 steps. A global-lock
wait is usually microseconds (an idle manager) and, under contention or failover, up to a second.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from tract_async.extras import require

require("prometheus_client", purpose="the serving metrics (tract_async.serving.metrics)")
from prometheus_client import CollectorRegistry, Counter, Histogram, Info  # noqa: E402
from prometheus_client.exposition import choose_encoder  # noqa: E402

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)
LOCK_WAIT_BUCKETS: tuple[float, ...] = (
    1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)
#: Request outcomes counted by ``tract_requests_total{outcome=...}``.
OUTCOMES = ("ok", "error", "cancelled")


class ServiceMetrics:
    """The metrics of one service, registered in a registry of its own.

    Names (with the default ``namespace="tract"``): ``tract_ttft_seconds`` (histogram),
    ``tract_requests_total{outcome}``, ``tract_prefix_hit_blocks_total``,
    ``tract_bytes_moved_total{transport,direction}``, ``tract_lock_wait_seconds`` (histogram),
    and ``tract_service_info{service,role,node_id}``.
    """

    def __init__(self, service: str, *, role: str = "", node_id: int | None = None,
                 namespace: str = "tract") -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.info = Info("service", "Which service this is.", namespace=namespace, registry=reg)
        self.info.info({"service": service, "role": role, "node_id": "" if node_id is None else str(node_id)})
        self.ttft = Histogram(
            "ttft_seconds", "Time to first token: request arrival to first token ready.",
            namespace=namespace, registry=reg, buckets=TTFT_BUCKETS,
        )
        self.requests = Counter(
            "requests", "Requests finished, by outcome (ok, error, cancelled).",
            labelnames=("outcome",), namespace=namespace, registry=reg,
        )
        self.prefix_hit_blocks = Counter(
            "prefix_hit_blocks", "KV blocks served from the prefix cache instead of recomputed.",
            namespace=namespace, registry=reg,
        )
        self.bytes_moved = Counter(
            "bytes_moved", "KV bytes moved, by transport (region, http) and direction (put, get).",
            labelnames=("transport", "direction"), namespace=namespace, registry=reg,
        )
        self.lock_wait = Histogram(
            "lock_wait_seconds", "Time spent waiting for the rack-wide lock.",
            namespace=namespace, registry=reg, buckets=LOCK_WAIT_BUCKETS,
        )
        for outcome in OUTCOMES:  # export zeros from the start, so rate() has a baseline
            self.requests.labels(outcome=outcome)

    def observe_ttft(self, seconds: float) -> None:
        """Record one request's time to first token.

        Raises:
            ValueError: ``seconds`` is negative (a clock mix-up, not a measurement).
        """
        if seconds < 0:
            raise ValueError(f"TTFT cannot be negative, got {seconds}")
        self.ttft.observe(seconds)

    def count_request(self, outcome: str = "ok") -> None:
        """Count one finished request.

        Raises:
            ValueError: ``outcome`` is not one of :data:`OUTCOMES`.
        """
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        self.requests.labels(outcome=outcome).inc()

    def add_prefix_hit_blocks(self, blocks: int) -> None:
        """Count blocks a lookup found resident (``len(eng.lookup(keys))``).

        Raises:
            ValueError: ``blocks`` is negative.
        """
        self.prefix_hit_blocks.inc(blocks)

    def add_bytes_moved(self, nbytes: int, *, transport: str = "region", direction: str = "put") -> None:
        """Count KV bytes moved by ``put_kv``/``get_kv``.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        self.bytes_moved.labels(transport=transport, direction=direction).inc(nbytes)

    def observe_lock_wait(self, seconds: float) -> None:
        """Record one wait for the global lock.

        Raises:
            ValueError: ``seconds`` is negative.
        """
        if seconds < 0:
            raise ValueError(f"lock wait cannot be negative, got {seconds}")
        self.lock_wait.observe(seconds)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The registry rendered for a scraper: ``(body, content_type)``.

        ``accept`` is the request's Accept header: Prometheus asking for OpenMetrics gets it,
        anything else gets the classic text format.
        """
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def metrics_handler(metrics: ServiceMetrics) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler serving ``metrics`` as text: ``app.router.add_get("/metrics", h)``.

    Rendering is synchronous but proportional to the (small, fixed) number of series, so it runs
    on the loop; it reads counters without blocking their writers.
    """

    async def handle(request: web.Request) -> web.Response:
        body, content_type = metrics.exposition(request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return handle
