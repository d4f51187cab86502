"""The load benchmark's metrics: what the paper reports, computed from request records.

Definitions (every one is checked against hand-computed values in ``tests/serving/test_loadgen.py``):

* **TTFT**: client-side, request written -> first token read (:class:`RequestRecord.ttft_s`);
  mean and p50/p90/p99 over the completed requests, percentiles linearly interpolated
  (numpy's default), in ms.
* **TPOT**: per request, (last token - first token) / (output tokens - 1); its mean and p50/p99
  over the requests with at least two tokens.
* **duration**: first send -> last end of the phase's requests (failed ones included: a request
  that timed out occupied the run). **throughput**: completed requests / duration (req/s),
  output tokens / duration (tok/s), prompt tokens of completed requests / duration.
* **goodput**: completed requests whose TTFT met the SLO (``ttft <= slo``) / duration, and the
  fraction of all requests that met it.
* **hit rate**: prefix-cache blocks hit / full blocks, over completed requests (block-weighted,
  as the prefill worker's lookup counts them), next to the workload's ideal.
* **breakdown** (:func:`breakdown_ms`): per request, from the router's event timeline.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tract_async.loadtest.generator import RequestRecord
from tract_async.serving.workload import percentile

#: Breakdown components, in the order the bars stack.
COMPONENTS: tuple[str, ...] = ("queue", "prefix_load", "prefill_compute", "kv_store", "kv_load",
                               "first_decode_step", "token_delivery")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _layers(events: Mapping[str, float], prefix: str) -> list[float]:
    return [t for name, t in events.items()
            if name.startswith(prefix) and name[len(prefix):].isdigit()]


def breakdown_ms(events: Mapping[str, float], router_ttft_ms: float = math.nan) -> dict[str, float]:
    """Where one request's time went, from the router's events (ms after the router got it)
    and the router's own TTFT.

    * ``queue``: waiting for a worker's compute slot: prefill (``prefill_compute_start`` after
      the request reached it and read any prefix hit) plus decode (``decode_compute_start``
      after its KV was in hand: the fetch in http and rdma-model, the last layer's put with
      layer streaming, the request's arrival in recompute);
    * ``prefix_load``: the prefill reading its cache hit from the region (``hit_read`` after
      ``lookup_done``);
    * ``prefill_compute``: ``prefill_compute_start`` -> ``prefill_done`` (the forward pass; the
      layer stores it overlaps are in it too);
    * ``kv_store``: the sum of the per-layer stores (``store_begin_L{i}`` -> ``put_L{i}``), which
      overlap the compute of later layers, or the one store of every layer after the compute
      (``kv_store_begin`` -> ``kv_store_done``, nixl);
    * ``kv_load``: what the transfer added once the KV was complete at the prefill: the HTTP READ
      (``decode_recv`` -> ``http_read_done``), the modelled RDMA transfer or the one NIXL get
      of every layer (``kv_load_begin`` -> ``kv_load_done``), or, with layer streaming, the
      last layer's hop (from ``put_L{last}``, or from when the reads began if later:
      ``early_reads``, or ``decode_compute_start`` in records without it, to ``got_L{last}``);
    * ``first_decode_step``: the decode worker's first forward pass, ``decode_compute_start`` ->
      ``first_token`` (recompute: the whole prompt's); with layer streaming, only what is left
      of it after the last layer arrived (``got_L{last}`` -> ``first_token``), or from
      ``decode_compute_start`` when every layer was read before decode got its slot (the wait
      for the slot is queue, counted once);
    * ``token_delivery``: from the decode worker's event loop taking the first token
      (``first_token``) to the router having written it to the client (its TTFT): the NDJSON
      hop, and whatever else holds either event loop (or the GIL) at that moment.

    Components absent from a request's events are 0 (recompute has no prefill; http no store
    into a region). They are durations, not a partition: with layer streaming the stores overlap
    the compute, so they need not add up to the TTFT.
    """
    e = dict(events)
    out = dict.fromkeys(COMPONENTS, 0.0)
    ready = max((e[k] for k in ("prefill_recv", "lookup_done", "hit_read") if k in e), default=None)
    if "prefill_compute_start" in e and ready is not None:
        out["queue"] += max(0.0, e["prefill_compute_start"] - ready)
    if "hit_read" in e and "lookup_done" in e:
        out["prefix_load"] = e["hit_read"] - e["lookup_done"]
    if "prefill_done" in e and "prefill_compute_start" in e:
        out["prefill_compute"] = e["prefill_done"] - e["prefill_compute_start"]
    out["kv_store"] = sum(e[f"put_L{i}"] - e[f"store_begin_L{i}"]
                          for i in range(len(_layers(e, "put_L")))
                          if f"put_L{i}" in e and f"store_begin_L{i}" in e)
    if "kv_store_done" in e and "kv_store_begin" in e:    # every layer in one put (nixl)
        out["kv_store"] += e["kv_store_done"] - e["kv_store_begin"]
    got = _layers(e, "got_L")
    last_got = max(got) if got else None
    puts = _layers(e, "put_L")
    dcs = e.get("decode_compute_start")
    streamed = False
    if "http_read_done" in e and "decode_recv" in e:
        out["kv_load"] = e["http_read_done"] - e["decode_recv"]
        decode_ready = e["http_read_done"]
    elif "kv_load_done" in e and "kv_load_begin" in e:
        out["kv_load"] = e["kv_load_done"] - e["kv_load_begin"]
        decode_ready = e["kv_load_done"]
    elif puts and last_got is not None:
        # layer streaming: the reads began at ``early_reads`` (the request reached decode and
        # read while it waited for a slot) or, in records without it, at the slot (dcs); only
        # the last layer's hop after both the KV was complete and the reads had begun is on the
        # critical path. A request that read early was ready for a slot once it held its KV
        # (a first pass that starts after every layer arrived queued only from then on)
        kv_ready = max(puts)
        reads_from = e.get("early_reads", dcs)
        out["kv_load"] = max(0.0, last_got - max(kv_ready, reads_from if reads_from is not None
                                                 else kv_ready))
        decode_ready = max(kv_ready, last_got) if "early_reads" in e else kv_ready
        streamed = True
    else:   # recompute, or a prompt without a full block: nothing travels
        decode_ready = e.get("decode_recv")
    if decode_ready is not None and dcs is not None:
        out["queue"] += max(0.0, dcs - decode_ready)
    if "first_token" in e:
        # the whole first forward pass when the KV was local before it began; with layer
        # streaming only what is left after the last layer arrived (the rest overlapped it)
        start = (max(last_got, dcs) if dcs is not None else last_got) if streamed else dcs
        if start is not None:
            out["first_decode_step"] = max(0.0, e["first_token"] - start)
        if not math.isnan(router_ttft_ms):
            out["token_delivery"] = max(0.0, router_ttft_ms - e["first_token"])
    return out


def summarize(records: Sequence[RequestRecord], *, ttft_slo_ms: float) -> dict[str, Any]:
    """The metrics of one phase (one system, workload and load), as defined above."""
    done = [r for r in records if r.ok]
    ttft = [r.ttft_s * 1e3 for r in done]
    tpot = [r.tpot_s * 1e3 for r in done if not math.isnan(r.tpot_s)]
    sent = [r.sent_s for r in records if not math.isnan(r.sent_s)]
    ends = [r.end_s for r in records if not math.isnan(r.end_s)]
    duration = (max(ends) - min(sent)) if ends and sent else math.nan
    good = sum(1 for x in ttft if x <= ttft_slo_ms)
    full = sum(r.full_blocks for r in done)
    lag = [r.sent_s - r.scheduled_s for r in records
           if not (math.isnan(r.sent_s) or math.isnan(r.scheduled_s))]
    parts = [breakdown_ms(r.events_ms, r.router_ttft_ms) for r in done]

    def rate(n: float) -> float:
        return n / duration if duration and duration > 0 else math.nan

    return {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "ttft_mean_ms": _mean(ttft), "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90), "ttft_p99_ms": percentile(ttft, 99),
        "tpot_mean_ms": _mean(tpot), "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
        "e2e_mean_ms": _mean([r.e2e_s * 1e3 for r in done]),
        "router_ttft_mean_ms": _mean([r.router_ttft_ms for r in done
                                      if not math.isnan(r.router_ttft_ms)]),
        "throughput_rps": rate(len(done)),
        "output_tok_s": rate(sum(r.output_tokens for r in done)),
        "input_tok_s": rate(sum(r.prompt_tokens for r in done)),
        "ttft_slo_ms": ttft_slo_ms, "goodput_rps": rate(good),
        "slo_attainment": good / len(records) if records else math.nan,
        "hit_blocks": sum(r.hit_blocks for r in done), "full_blocks": full,
        "hit_rate": sum(r.hit_blocks for r in done) / full if full else 0.0,
        "kv_bytes": sum(r.kv_bytes for r in done),
        "send_lag_max_ms": max(lag) * 1e3 if lag else math.nan,
        "breakdown_mean_ms": {c: _mean([p[c] for p in parts]) for c in COMPONENTS},
    }


__all__ = ["COMPONENTS", "breakdown_ms", "summarize"]
