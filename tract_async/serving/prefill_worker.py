"""The prefill worker: computes a prompt's KV and hands each layer over as soon as it exists.

``POST /prefill`` (:class:`~tract_async.serving.protocol.PrefillRequest`) runs the model over
the prompt in a worker thread (:func:`~tract_async.serving.streaming.prefill_streaming`) and,
layer by layer while the next layer computes, moves the KV of the prompt's *full blocks* (the
ones with keys) to where the decode worker will read it:

* ``region-cache``: first ``lookup`` of the prompt's keys; the leading resident blocks are read
  from the region (``get_kv``) and not recomputed (a prefix hit); only the tokens after them are
  computed, and the new full blocks are ``put_kv`` layer by layer (the rack-wide prefix cache);
* ``region-transfer``: no lookup, no reuse; every full block is put layer by layer under keys
  salted with the request id (a block lives until its one consumer has read it);
* ``http``: every full block's KV is written into a span of the agent's registered pool, layer
  by layer; after the last layer the reply names the span for the decode worker's READ;
* ``rdma-model``: puts as ``region-transfer`` does, keys salted, into a cache-mode engine (the
  region only carries the bytes; the decode worker holds their arrival back to a modelled RDMA
  transfer: :mod:`.rdma_model`; ``protocol.engine_mode`` says why cache mode);
* ``nixl``: the full blocks' KV of every layer is put once, after the compute, into the
  engine's pool (GPU memory on a GPU), as the NIXL connectors of vLLM and Dynamo hand over a
  finished prefill; the decode worker then pulls it over NIXL (the router waits for this reply);
* ``recompute``: nothing is stored; the router does not call this worker (the decode worker
  computes the prompt itself), which stays up only so that every mode has the same rack.

The reply carries the first token the prefill computed, the hit, and timing events. ``GET
/health`` and ``GET /metrics`` (Prometheus text) are served too.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from tract_async.errors import TractError
from tract_async.serving.gclog import GcLog, LoopLag, cuda_alloc_counts
from tract_async.serving.errors import BadCompletionRequest, KVPoolFull
from tract_async.serving.metrics import ServiceMetrics
from tract_async.serving.protocol import (ENGINE_MODES, NET_MODES, SALTED_MODES, PrefillReply,
                                          PrefillRequest, error_body, now)
from tract_async.serving.service import (KVDevice, ServiceConfig, TaskOwner, agent_ready_info,
                                         agent_secret, check_before_model, kv_layout, load_model,
                                         open_engine, worker_app)


class PrefillWorker:
    """State of one prefill worker; built and torn down by :func:`_resources`."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.metrics = ServiceMetrics("prefill", role="prefill", node_id=cfg.node_id)
        self.model: Any = None
        self.cuda_gets: bool | None = None   # region reads into GPU memory: unknown until tried
        self.layout: Any = None
        self.engine: Any = None
        self.kvdev: KVDevice | None = None
        self.gclog: GcLog | None = None     # TRACT_PHASES=1: collections on the timeline
        self.looplag: LoopLag | None = None  # TRACT_PHASES=1: loop stalls on the timeline
        self.agent: Any = None
        self.exporter: Any = None
        self.tasks = TaskOwner()
        # One forward pass at a time, as one accelerator runs one batch at a time.
        self.compute = asyncio.Semaphore(1)
        self.served = 0

    @property
    def agent_url(self) -> str | None:
        return None if self.agent is None else f"http://{self.agent.config.host}:{self.agent.port}"

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "prefill", "mode": self.cfg.mode, "model": self.cfg.model,
                               "node_id": self.cfg.node_id, "served": self.served,
                               "ready": self.model is not None}
        if self.agent is not None:
            out.update(agent=self.agent.name, agent_url=self.agent_url,
                       pool_used_bytes=self.exporter.spans.used_bytes)
        if self.engine is not None:
            st = self.engine.stats()
            out["engine"] = {k: st.get(k) for k in ("hits", "misses", "bytes_put", "bytes_got",
                                                    "blocks_stored", "evictions", "lock_wait_s",
                                                    "lock_acquisitions")}
        return out

    # -- the request --------------------------------------------------------------------------
    async def prefill(self, req: PrefillRequest) -> PrefillReply:
        from tract_async.serving.streaming import prefill_streaming
        events: list[tuple[str, float]] = [("prefill_recv", now())]
        ids = list(req.prompt_ids)
        T = self.cfg.block_tokens
        n_full = len(ids) // T
        lock_before = self._lock_stats()
        hit, past_kv, past_len = 0, None, 0
        keys: list[bytes] = []
        if self.engine is not None:
            salt = (req.request_id,) if self.cfg.mode in SALTED_MODES else None
            keys = self.engine.block_keys(ids, extra_keys=salt)
            if self.cfg.mode == "region-cache" and keys:
                hit = self.engine.lookup(keys)
                events.append(("lookup_done", now()))
                if hit:
                    hit, past_kv = await self._read_hit(keys[:hit])
                    events.append(("hit_read", now()))
                past_len = min(hit * T, len(ids) - 1)
        first_block = math.ceil(past_len / T)          # the first full block computed here
        put_keys = keys[first_block:n_full]
        lo, hi = first_block * T - past_len, n_full * T - past_len   # its rows in the new KV
        moved = 0
        span: tuple[int, Any] | None = None
        if self.exporter is not None and n_full:
            shape = self.layout.kv_shape(n_full)
            span = await self.exporter.reserve(shape, self.layout.dtype, timeout=self.cfg.layer_timeout_s)

        whole: list[tuple[Any, Any]] = []      # nixl: (layer's KV, its ready event), put at the end

        async def put_layer(layer: int, kv_layer: Any, ready: Any = None) -> None:
            nonlocal moved
            if self.cfg.mode in NET_MODES:
                if put_keys:
                    whole.append((kv_layer[:, lo:hi], ready))
                return
            # store_begin_L / put_L bracket the store of one layer: the load benchmark's
            # "KV store" is their sum (the stores overlap the compute of the next layers)
            events.append((f"store_begin_L{layer}", now()))
            if span is not None:
                span[1][layer].copy_(kv_layer[:, :n_full * T])
                moved += span[1][layer].numel() * span[1][layer].element_size()
            elif put_keys:
                await self.kvdev.put_layer(put_keys, kv_layer[:, lo:hi], layer, events, ready)
                moved += (hi - lo) * self.layout.layer_bytes // T
            events.append((f"put_L{layer}", now()))

        on_computed: Callable[[int], None] | None = None
        allocs_before: dict[str, int] = {}
        if self.gclog is not None:          # TRACT_PHASES=1: the computing thread's side too
            def stamp(layer: int) -> None:
                events.append((f"computed_L{layer}", now()))
            on_computed = stamp
            allocs_before = cuda_alloc_counts()
        try:
            async with self.compute:
                events.append(("prefill_compute_start", now()))
                result = await prefill_streaming(self.model, ids, put_layer=put_layer,
                                                 past_kv=past_kv, past_len=past_len,
                                                 on_computed=on_computed)
                if whole:
                    moved += await self._put_whole(put_keys, whole, events)
        except BaseException:
            if span is not None:
                await asyncio.shield(self.exporter.discard(span[0]))
            raise
        events.append(("prefill_done", now()))
        if self.gclog is not None:          # before prefill_done: _observe reads it last
            t0, t1 = events[0][1], events[-1][1]
            extra = self.gclog.events_between(t0, t1)
            if self.looplag is not None:
                extra += self.looplag.events_between(t0, t1)
            # the allocator's device calls during the request, as marks at its end
            # (``cuda_num_device_alloc+3``): a cudaMalloc or a retry may synchronize
            after = cuda_alloc_counts()
            extra += [(f"cuda_{k}+{after[k] - v}", t1) for k, v in allocs_before.items()
                      if after.get(k, v) != v]
            events[-1:-1] = extra
        kv_source = None
        if span is not None:
            kv_source = self.exporter.publish(req.request_id, span[0], moved, n_full * T,
                                              req.kv_consumer or "decode", self.agent_url)
        self._observe(events, hit, moved, lock_before)
        return PrefillReply(request_id=req.request_id, first_token=result.next_token,
                            prompt_tokens=len(ids), full_blocks=n_full, hit_blocks=hit,
                            computed_tokens=len(ids) - past_len, kv_bytes=moved,
                            kv_source=kv_source, events=events)

    async def _put_whole(self, keys: list[bytes], layers: list[tuple[Any, Any]],
                         events: list[tuple[str, float]]) -> int:
        """nixl: every layer of the prompt's full blocks in one put (``kv_store_begin`` ->
        ``kv_store_done``); returns the bytes stored. The layers are stacked on the current
        stream once each one's compute is done (its ``ready`` event)."""
        import torch
        events.append(("kv_store_begin", now()))
        for kv_layer, ready in layers:
            if ready is not None:
                torch.cuda.current_stream(kv_layer.device).wait_event(ready)
        kv = torch.stack([kv_layer for kv_layer, _ in layers])
        assert self.kvdev is not None
        await self._put_when_room(keys, kv, events)
        events.append(("kv_store_done", now()))
        return kv.numel() * kv.element_size()

    async def _put_when_room(self, keys: list[bytes], kv: Any,
                             events: list[tuple[str, float]]) -> None:
        """The engine's put, waiting while its pool is full of KV that decode workers have not
        read yet (up to ``layer_timeout_s``, as the http mode waits for its span pool), then
        KVPoolFull (503). Without the wait a nixl prefill answered 500 (RegionFull) as soon as
        its decode workers fell behind (H100, 4.2 req/s: ``bench/results/gpu-20261207-s50``,
        call 3). Pool slots come back as the decode workers consume their reads, so the
        wait polls: 2 ms, doubling to 50 ms."""
        from tract_async.errors import RegionFull
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.layer_timeout_s
        delay = 0.002
        waited = False
        while True:
            try:
                await self.kvdev.put_layer(keys, kv, None)      # type: ignore[union-attr]
                return
            except RegionFull as exc:
                if loop.time() + delay > deadline:
                    raise KVPoolFull(f"no room in the KV pool within {self.cfg.layer_timeout_s}"
                                     f" s: {exc}") from exc
                if not waited:
                    events.append(("kv_store_full", now()))
                    waited = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)

    async def _read_hit(self, keys: list[bytes]) -> tuple[int, Any]:
        """The hit blocks' KV from the region; a block evicted since the lookup is a miss."""
        from tract_async.errors import BlockEvicted, BlockNotFound, LayerNotReady, TensorMismatch
        device = self.model.lm_head.weight.device
        try:
            if device.type == "cuda" and self.cuda_gets is not False:
                # straight into GPU memory: a CPU get plus a pageable .to(cuda) of a 191-block
                # prefix (~380 MiB of Llama-3-8B KV) took ~350 ms of the TTFT on the H200
                try:
                    kv = await self.engine.get_kv(keys, device=device)
                    self.cuda_gets = True
                except TensorMismatch:
                    if self.cuda_gets:
                        raise
                    self.cuda_gets = False
                    kv = await self.engine.get_kv(keys)
            else:
                kv = await self.engine.get_kv(keys)
        except (BlockEvicted, BlockNotFound, LayerNotReady):
            return 0, None
        self.metrics.add_bytes_moved(kv.numel() * kv.element_size(), transport="region",
                                     direction="get")
        return len(keys), kv.to(device)

    def _lock_stats(self) -> tuple[int, float]:
        if self.engine is None:
            return 0, 0.0
        st = self.engine.stats()
        return int(st.get("lock_acquisitions", 0)), float(st.get("lock_wait_s", 0.0))

    def _observe(self, events: list[tuple[str, float]], hit: int, moved: int,
                 lock_before: tuple[int, float]) -> None:
        self.served += 1
        self.metrics.count_request("ok")
        self.metrics.add_prefix_hit_blocks(hit)
        self.metrics.observe_ttft(events[-1][1] - events[0][1])   # this worker's own TTFT
        self.metrics.add_bytes_moved(moved, transport="http" if self.agent else "region",
                                     direction="put")
        n, waited = self._lock_stats()
        if n > lock_before[0]:   # one observation per acquisition: the mean of this request's
            per = (waited - lock_before[1]) / (n - lock_before[0])
            for _ in range(n - lock_before[0]):
                self.metrics.observe_lock_wait(max(per, 0.0))


PREFILL_KEY = web.AppKey("prefill_worker", PrefillWorker)


async def _resources(app: web.Application) -> AsyncIterator[None]:
    """Model, then engine or agent; released in reverse order."""
    w = app[PREFILL_KEY]
    cfg = w.cfg
    check_before_model(cfg)
    w.model = await asyncio.to_thread(load_model, cfg)
    w.layout = kv_layout(cfg, w.model)
    async with contextlib.AsyncExitStack() as stack:
        if cfg.mode == "http":
            from tract_async.serving.http_kv import KVExporter
            from tract_async.transport.http import Agent
            secret = agent_secret()
            w.agent = Agent(f"prefill-{cfg.node_id}", host=cfg.host, secret=secret,
                            allow_unauthenticated=secret is None)
            w.exporter = KVExporter(w.agent, cfg.kv_pool_bytes, hold_s=cfg.kv_hold_s, tasks=w.tasks)
            await w.agent.start()
            stack.push_async_callback(w.agent.close)
        elif cfg.mode in ENGINE_MODES:
            w.engine = await open_engine(cfg, w.layout)
            stack.push_async_callback(w.engine.close)
            if os.environ.get("TRACT_PHASES") == "1":   # reserved_L / enqueued_L, gc markers
                w.engine.time_phases()
                w.gclog = GcLog(now).install()
                w.looplag = LoopLag(now)
                w.tasks.spawn(w.looplag.run(), name="loop-lag")
            w.kvdev = KVDevice(w.engine)
        # tasks close first (before the agent / engine they use)
        stack.push_async_callback(w.tasks.close)
        yield


async def handle_prefill(request: web.Request) -> web.Response:
    w = request.app[PREFILL_KEY]
    try:
        body = await request.json()
        req = PrefillRequest.from_json(body, w.model.config.vocab_size)
        reply = await w.prefill(req)
    except (BadCompletionRequest, ValueError) as exc:
        w.metrics.count_request("error")
        return web.json_response(error_body(exc, 400), status=400)
    except KVPoolFull as exc:
        w.metrics.count_request("error")
        return web.json_response(error_body(exc, 503), status=503)
    except TractError as exc:
        w.metrics.count_request("error")
        return web.json_response(error_body(exc, 500), status=500)
    except asyncio.CancelledError:
        w.metrics.count_request("cancelled")
        raise
    return web.json_response(reply.to_json())


def build_app(cfg: ServiceConfig) -> web.Application:
    """The prefill worker's application (the resources are built when it starts)."""
    return worker_app(cfg, "prefill", PREFILL_KEY, PrefillWorker(cfg), "/prefill", handle_prefill,
                      _resources)


def ready_info(app: web.Application) -> dict[str, Any]:
    return agent_ready_info(app[PREFILL_KEY])


__all__ = ["PREFILL_KEY", "PrefillWorker", "build_app", "ready_info"]
