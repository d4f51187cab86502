"""The async load generator: arrival processes, the streaming client, open and closed loops.

Two ways to load a server, because they answer two questions:

* **open loop** (:func:`run_open_loop`): requests arrive on a schedule that does not care how
  the server is doing, as independent users do: a Poisson process at a given rate (or a gamma
  process with the same mean for burstier traffic). Latency under a given offered load, and
  where it breaks, is only visible this way: a closed loop slows its own arrivals down when the
  server slows down and so hides queueing (coordinated omission).
* **closed loop** (:func:`run_closed_loop`): ``N`` clients, each sending its next request as soon
  as its previous one has finished. The server is never idle, so this gives peak throughput.

A request's time to first token is measured here, by the client: from the moment its request
was written (``sent_s``) to the moment the first token's chunk was read (``first_token_s``).
The schedule's own time (``scheduled_s``) is kept too; a send later than scheduled means the
client itself fell behind, and the report says so rather than hiding it. Every request's
failure is recorded on its record (``error``), never raised: one failed request must not cancel
the others of a run.

Times are ``time.perf_counter()`` seconds relative to the loop's start.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import aiohttp
import numpy as np
import orjson

from tract_async.loadtest.workloads import LoadRequest
from tract_async.serving.workload import StreamCutShort, completion_messages


# --- arrivals -----------------------------------------------------------------------------------
def interarrival_gaps(n: int, rate: float, *, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """``n`` gaps (seconds) between arrivals of a process of ``rate`` requests per second.

    ``burstiness`` 1 is a Poisson process (exponential gaps); other values draw gamma gaps of
    shape ``burstiness`` and the same mean ``1 / rate`` (below 1: burstier; above: more even).
    ``rate`` ``inf`` gives zeros (everything at once).

    Raises:
        ValueError: ``n`` negative, ``rate`` not positive, ``burstiness`` not positive.
    """
    if n < 0 or not rate > 0 or not burstiness > 0:
        raise ValueError(f"need n >= 0, rate > 0, burstiness > 0; got {n}, {rate}, {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x9A95]))
    if burstiness == 1.0:
        return rng.exponential(1.0 / rate, size=n)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, *, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times (seconds from the start) of ``n`` requests: the first at 0, then the gaps
    of :func:`interarrival_gaps` (so the sending starts at once, as a benchmark should)."""
    gaps = interarrival_gaps(max(0, n - 1), rate, seed=seed, burstiness=burstiness)
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


# --- one request --------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class RequestRecord:
    """What one request did, as the client saw it and as the router reported it."""
    index: int
    workload: str
    group: int
    step: int
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float = math.nan
    sent_s: float = math.nan
    first_token_s: float = math.nan
    end_s: float = math.nan
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)   # greedy: equal everywhere
    error: str | None = None
    # from the router's final chunk (``tract``): its own TTFT, the prefix hit, the events
    router_ttft_ms: float = math.nan
    hit_blocks: int = 0
    full_blocks: int = 0
    kv_bytes: int = 0
    events_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; NaN with fewer than two tokens."""
        if self.output_tokens < 2 or not self.token_times_s:
            return math.nan
        return (self.token_times_s[-1] - self.first_token_s) / (self.output_tokens - 1)

    @classmethod
    def for_request(cls, req: LoadRequest) -> RequestRecord:
        return cls(index=req.index, workload=req.workload, group=req.group, step=req.step,
                   prompt_tokens=len(req.prompt_ids), max_tokens=req.max_tokens)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["token_times_s"] = [round(t, 6) for t in self.token_times_s]
        return d


async def send_request(session: aiohttp.ClientSession, url: str, req: LoadRequest,
                       rec: RequestRecord, clock: Callable[[], float], *,
                       timeout_s: float) -> RequestRecord:
    """One streaming ``/v1/completions`` request, its timings written into ``rec``.

    Never raises for the request's own failure (HTTP status, in-band error, timeout, a
    stream cut short): that goes to ``rec.error``, and ``end_s`` is when it ended. Cancellation
    propagates.
    """
    body = orjson.dumps({"prompt": list(req.prompt_ids), "max_tokens": req.max_tokens,
                         "stream": True, "temperature": 0})
    rec.sent_s = clock()
    try:
        return await _stream(session, url, body, rec, clock, timeout_s)
    finally:
        if math.isnan(rec.end_s):   # failed or cancelled: when it ended still counts
            rec.end_s = clock()


async def _stream(session: aiohttp.ClientSession, url: str, body: bytes, rec: RequestRecord,
                  clock: Callable[[], float], timeout_s: float) -> RequestRecord:
    try:
        async with session.post(f"{url}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            async for msg in completion_messages(r):
                if "error" in msg:
                    rec.error = f"in-band error: {str(msg['error'])[:200]}"
                    return rec
                ids = msg["choices"][0].get("token_ids") or []
                if ids:
                    t = clock()
                    if not rec.output_tokens:
                        rec.first_token_s = t
                    rec.output_tokens += len(ids)
                    rec.output_ids += [int(i) for i in ids]
                    rec.token_times_s += [t] * len(ids)
                tract = msg.get("tract")
                if tract:
                    _take_router_report(rec, tract)
        rec.end_s = clock()
    except StreamCutShort as exc:
        rec.error = str(exc)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    return rec


def _take_router_report(rec: RequestRecord, tract: dict[str, Any]) -> None:
    ttft = tract.get("ttft_ms")
    rec.router_ttft_ms = float(ttft) if ttft is not None else math.nan
    rec.hit_blocks = int(tract.get("hit_blocks", 0))
    rec.full_blocks = int(tract.get("full_blocks", 0))
    rec.kv_bytes = int(tract.get("kv_bytes", 0))
    rec.events_ms = {str(k): float(v) for k, v in tract.get("events_ms", {}).items()}


# --- progress -----------------------------------------------------------------------------------
class Progress:
    """Live counters of a run: a tqdm bar on a terminal, else one plain line every few seconds.

    ``start(rec)`` / ``finish(rec)`` as requests go out and come back; ``close()`` prints the
    last state. Counters: done, in flight, errors, and the running TTFT p50 of this phase.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 line_every_s: float = 5.0) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.line_every_s = line_every_s
        self.done = self.in_flight = self.errors = 0
        self._ttfts: list[float] = []
        self._last_line = time.perf_counter()
        self._bar: Any = None
        if self.stream.isatty():
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=label, file=self.stream, leave=True,
                                 dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def counters(self) -> dict[str, Any]:
        xs = sorted(self._ttfts)
        p50 = xs[len(xs) // 2] * 1e3 if xs else math.nan
        return {"done": self.done, "in_flight": self.in_flight, "errors": self.errors,
                "ttft_p50_ms": round(p50, 1)}

    def start(self, rec: RequestRecord) -> None:
        self.in_flight += 1

    def finish(self, rec: RequestRecord) -> None:
        self.in_flight -= 1
        self.done += 1
        if rec.ok:
            self._ttfts.append(rec.ttft_s)
        else:
            self.errors += 1
        c = self.counters()
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(inflight=c["in_flight"], err=c["errors"],
                                  ttft_p50=f"{c['ttft_p50_ms']}ms", refresh=False)
        elif time.perf_counter() - self._last_line >= self.line_every_s or self.done == self.total:
            self._line()

    def _line(self) -> None:
        c = self.counters()
        self._last_line = time.perf_counter()
        print(f"{self.label}: {c['done']}/{self.total} done, {c['in_flight']} in flight, "
              f"{c['errors']} errors, TTFT p50 {c['ttft_p50_ms']} ms", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# --- the loops ----------------------------------------------------------------------------------
def _session(limit: int) -> aiohttp.ClientSession:
    # One connection per request in flight: a pool smaller than the load would queue requests in
    # the client and show up as server latency.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, limit)))


async def run_open_loop(url: str, requests: Sequence[LoadRequest], arrivals_s: Sequence[float], *,
                        timeout_s: float = 300.0, progress: Progress | None = None,
                        max_in_flight: int = 1024) -> list[RequestRecord]:
    """Send request ``i`` at ``arrivals_s[i]`` (seconds from now), whatever is still in flight.

    Returns one record per request, in request order, once every request has ended.

    Raises:
        ValueError: ``arrivals_s`` is not one time per request, or not sorted.
    """
    if len(arrivals_s) != len(requests) or any(b < a for a, b in zip(arrivals_s, arrivals_s[1:])):
        raise ValueError("arrivals_s must hold one sorted time per request")
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    records = [RequestRecord.for_request(r) for r in requests]

    async def one(req: LoadRequest, rec: RequestRecord, session: aiohttp.ClientSession) -> None:
        if progress is not None:
            progress.start(rec)
        try:
            await send_request(session, url, req, rec, clock, timeout_s=timeout_s)
        finally:
            if progress is not None:
                progress.finish(rec)

    async with _session(max_in_flight) as session, asyncio.TaskGroup() as tg:
        for req, rec, at in zip(requests, records, arrivals_s):
            rec.scheduled_s = float(at)
            delay = at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tg.create_task(one(req, rec, session))
    return records


async def run_closed_loop(url: str, requests: Sequence[LoadRequest], concurrency: int, *,
                          timeout_s: float = 300.0,
                          progress: Progress | None = None) -> list[RequestRecord]:
    """``concurrency`` clients take the requests in order, each sending its next one as soon as
    its previous one has ended. Returns one record per request, in request order.

    Raises:
        ValueError: ``concurrency`` < 1.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    records = [RequestRecord.for_request(r) for r in requests]
    next_index = iter(range(len(requests)))

    async def client(session: aiohttp.ClientSession) -> None:
        for i in next_index:   # one shared iterator: each request goes to exactly one client
            rec = records[i]
            rec.scheduled_s = clock()
            if progress is not None:
                progress.start(rec)
            try:
                await send_request(session, url, requests[i], rec, clock, timeout_s=timeout_s)
            finally:
                if progress is not None:
                    progress.finish(rec)

    async with _session(concurrency) as session, asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(client(session))
    return records


__all__ = ["Progress", "RequestRecord", "arrival_times", "interarrival_gaps", "run_closed_loop",
           "run_open_loop", "send_request"]
