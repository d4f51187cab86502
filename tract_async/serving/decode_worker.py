"""The decode worker: gets the prompt's KV layer by layer and streams generated tokens.

``POST /decode`` (:class:`~tract_async.serving.protocol.DecodeRequest`) answers with NDJSON: one
``{"token": id}`` line per generated token as soon as it exists, then ``{"done": true, ...}``
with timing events (or ``{"error": ...}`` once the stream has started).

The prompt's *full blocks* come from the transport; the decode worker computes the rest itself,
in its first forward pass (:func:`~tract_async.serving.streaming.generate_streaming`): the
tokens of the partial last block, which has no key, and always the last prompt token, whose
logits are the first generated token. So the first token the client sees comes from here, after
the KV arrived, as in vLLM's disaggregated serving. Layer ``i`` of that pass waits for layer
``i`` of the prompt's KV:

* region modes: ``get_kv(keys, layer=i, timeout=...)``, which waits in the region for a layer
  the prefill worker is still producing, so decode runs layer ``i`` while prefill computes
  ``i + 1`` (the router starts both at once);
* http mode: the whole KV is READ over the agent first (the baseline: the transfer starts after
  the prefill has finished), then the layers are taken from that buffer;
* rdma-model: the whole KV in one region get once the prefill has finished (the router waits
  for it), its arrival held back to a modelled RDMA transfer (:mod:`.rdma_model`);
* nixl: the whole KV in one get from the prefill's engine (NIXL READs of its pool) once the
  prefill has finished (the router waits for it), as the NIXL connectors of vLLM and Dynamo do;
* recompute: no KV arrives; the first forward pass computes the whole prompt here.

Requests share the compute (``ServiceConfig.decode_batch``, default 8): each one's first forward
pass runs alone, then its steps run batched with the others' (:mod:`.batching`, static cache and
CUDA graphs in :mod:`.fast_decode`). ``decode_batch=0`` serves one request at a time through
transformers' step, as before.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from tract_async.errors import TractError
from tract_async.serving.gclog import GcLog, LoopLag
from tract_async.serving.prefetch import LayerStream
from tract_async.serving.errors import BadCompletionRequest, KVUnavailable
from tract_async.serving.metrics import ServiceMetrics
from tract_async.serving.protocol import (ENGINE_MODES, SALTED_MODES, SEQUENTIAL_MODES,
                                          DecodeRequest, decode_past_len, error_body, now)
from tract_async.serving.service import (ServiceConfig, TaskOwner, agent_ready_info,
                                         agent_secret, check_before_model, kv_layout, load_model,
                                         open_engine, worker_app)

#: Modes whose decode reads every layer in one engine get after the prefill has answered: the
#: sequential modes that move KV through an Engine (rdma-model, nixl).
WHOLE_GET_MODES: tuple[str, ...] = tuple(m for m in SEQUENTIAL_MODES if m in ENGINE_MODES)


class DecodeWorker:
    """State of one decode worker; built and torn down by :func:`_resources`."""

    READ_AHEAD: int | None = None
    """How many layers past the one the decode step needs its reader may read (``serving/
    prefetch.py``, ``LayerStream``): None, every layer as soon as it is published. One reader
    waits at a time, so no more pollers run than cores allow (the former
    prefetch, started a read per layer ahead: two on hosts of more than 4 cores)."""

    EARLY_READS: int = 4
    """The default of ``ServiceConfig.early_reads``: how many requests may read their layers
    before they hold the compute slot (0: none). A request
    that arrives while another one decodes would otherwise start its reads only when the slot
    frees, after its prefill has long published every layer: the H100 serving run of
    2026-12-06 (``bench/results/gpu-20261206-s37/call2-h100-785a8b9-serve``) shows a 352-block
    request taking the slot 69 ms after its last layer was published and holding its KV 126 ms
    later, the whole transfer on the TTFT. Reading early costs GPU memory (the request's KV,
    which its decode holds anyway) for the time it waits: the bound keeps that to a few
    requests' worth; past it, a request reads once it computes, as before."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.metrics = ServiceMetrics("decode", role="decode", node_id=cfg.node_id)
        self.model: Any = None
        self.cuda_gets: bool | None = None   # region gets into GPU memory: unknown until tried
        self.layout: Any = None
        self.engine: Any = None
        self.agent: Any = None
        self.importer: Any = None
        self.tasks = TaskOwner()
        self.compute = asyncio.Semaphore(1)
        self.early = asyncio.Semaphore(cfg.early_reads)
        # decode_batch > 0: one compute thread batches every request's steps (serving/
        # batching.py); requests read their layers as soon as they arrive, up to decode_batch +
        # early_reads of them at a time (the KV they hold in memory)
        self.batcher: Any = None
        self.readers = asyncio.Semaphore(cfg.decode_batch + cfg.early_reads)
        self.kv_holders = 0
        """Requests of the batched path holding KV now: from their reads' start to their
        generation's end (``health``: the most at once, against ``readers``' limit)."""
        self.kv_holders_max = 0
        self.gclog: GcLog | None = None       # TRACT_PHASES=1: collections on the timeline
        self.looplag: LoopLag | None = None   # TRACT_PHASES=1: loop stalls on the timeline
        self.served = 0

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "decode", "mode": self.cfg.mode, "model": self.cfg.model,
                               "node_id": self.cfg.node_id, "served": self.served,
                               "ready": self.model is not None}
        if self.agent is not None:
            out.update(agent=self.agent.name,
                       agent_url=f"http://{self.agent.config.host}:{self.agent.port}")
        if self.engine is not None:
            st = self.engine.stats()
            out["engine"] = {k: st.get(k) for k in ("hits", "misses", "bytes_got", "consumed",
                                                    "layer_waits", "lock_wait_s",
                                                    "lock_acquisitions")}
        if self.batcher is not None:
            out["kv_holders"] = {"max": self.kv_holders_max,
                                 "limit": self.cfg.decode_batch + self.cfg.early_reads}
            out["batch"] = {"max_batch": self.batcher.max_batch, "steps": self.batcher.steps,
                            "max_seen_batch": self.batcher.max_seen_batch,
                            "graphs": self.batcher.decoder.graphs,
                            "captures": self.batcher.decoder.captures}
        return out

    @contextlib.contextmanager
    def _holding_kv(self) -> Any:
        """Count a request holding KV (``kv_holders``) for the duration."""
        self.kv_holders += 1
        self.kv_holders_max = max(self.kv_holders_max, self.kv_holders)
        try:
            yield
        finally:
            self.kv_holders -= 1

    def _kv_device(self) -> Any:
        """The model's CUDA device, where region gets should land (None: CPU tensors)."""
        if self.cuda_gets is False or self.model is None:
            return None
        p = next(self.model.parameters(), None)
        return p.device if p is not None and p.device.type == "cuda" else None

    async def _get_layer_kv(self, keys: list[bytes], layer: int | None, timeout: float,
                            device: Any) -> Any:
        """One layer of the request's blocks. With a CUDA model the engine DMAs it straight into
        GPU memory (a CPU get plus a pageable ``.to(cuda)`` cost ~8 ms a layer for 213 blocks on
        the H200); if the engine refuses CUDA tensors, later gets come back as CPU tensors."""
        from tract_async.errors import TensorMismatch
        if device is not None and self.cuda_gets is not False:
            try:
                kv = await self.engine.get_kv(keys, layer=layer, timeout=timeout, device=device)
                self.cuda_gets = True
                return kv
            except TensorMismatch:
                if self.cuda_gets:
                    raise
                self.cuda_gets = False
        return await self.engine.get_kv(keys, layer=layer, timeout=timeout)

    def layer_source(self, req: DecodeRequest, events: list[tuple[str, float]]) -> tuple[int, Any]:
        """``(past_len, get_layer)`` for the request's transport (see the module docstring)."""
        ids = req.prompt_ids
        T = self.cfg.block_tokens
        n_full = len(ids) // T
        if n_full == 0 or self.cfg.mode == "recompute":
            return 0, None
        past_len = decode_past_len(len(ids), T)
        timeout = self.cfg.layer_timeout_s
        if self.engine is not None:
            from tract_async.errors import BlockEvicted, BlockNotFound
            from tract_async.errors import TransferTimeout as RegionTimeout
            if self.cfg.mode in WHOLE_GET_MODES:
                return past_len, None   # one get of every layer, in read_whole
            salt = (req.request_id,) if self.cfg.mode in SALTED_MODES else None
            keys = self.engine.block_keys(list(ids), extra_keys=salt)[:n_full]
            layer_bytes = n_full * self.layout.layer_bytes

            device = self._kv_device()

            async def read_layer(layer: int) -> Any:
                try:
                    kv = await self._get_layer_kv(keys, layer, timeout, device)
                except (BlockEvicted, BlockNotFound, RegionTimeout) as exc:
                    raise KVUnavailable(f"request {req.request_id}: layer {layer} of {n_full} "
                                        f"blocks: {type(exc).__name__}: {exc}") from exc
                events.append((f"got_L{layer}", now()))
                self.metrics.add_bytes_moved(layer_bytes, transport="region", direction="get")
                return kv
            def asked(layer: int) -> None:
                # the compute thread wants layer ``layer``: after got_L, the read was early
                events.append((f"ask_L{layer}", now()))
            # every layer is read as soon as it is published, by one reader running ahead of
            # the compute (serving/prefetch.py, LayerStream)
            return past_len, LayerStream(read_layer, self.layout.num_layers,
                                         ahead=self.READ_AHEAD, on_ask=asked)

        if req.kv_source is None:
            raise BadCompletionRequest(f"http mode: a {len(ids)}-token prompt needs kv_source")
        return past_len, None   # the HTTP READ happens in read_http, before the compute

    async def read_http(self, req: DecodeRequest, events: list[tuple[str, float]]) -> Any:
        """http mode: the whole full-block KV over the agent (one READ). Raises KVUnavailable."""
        n_full = len(req.prompt_ids) // self.cfg.block_tokens
        shape = self.layout.kv_shape(n_full)
        kv = await self.importer.read(req.request_id, req.kv_source, shape, self.layout.dtype,
                                      timeout=self.cfg.layer_timeout_s)
        events.append(("http_read_done", now()))
        self.metrics.add_bytes_moved(kv.numel() * kv.element_size(), transport="http",
                                     direction="get")

        async def get_layer(layer: int) -> Any:
            events.append((f"got_L{layer}", now()))
            return kv[layer]
        return get_layer

    async def read_whole(self, req: DecodeRequest, events: list[tuple[str, float]]) -> Any:
        """rdma-model and nixl: every layer of the KV in one get (``kv_load_begin`` ->
        ``kv_load_done``); for rdma-model, available no earlier than a modelled RDMA transfer of
        its bytes would deliver it (``kv_model_due``). Raises KVUnavailable."""
        from tract_async.errors import BlockEvicted, BlockNotFound
        from tract_async.errors import TransferTimeout as RegionTimeout
        from tract_async.serving.rdma_model import sleep_until, transfer_s
        n_full = len(req.prompt_ids) // self.cfg.block_tokens
        keys = self.engine.block_keys(list(req.prompt_ids), extra_keys=(req.request_id,))[:n_full]
        t0 = now()
        nbytes = n_full * self.layout.block_bytes
        modelled = self.cfg.mode == "rdma-model"
        events.append(("kv_load_begin", t0))
        if modelled:
            due = t0 + transfer_s(nbytes, gbps=self.cfg.rdma_gbps,
                                  latency_us=self.cfg.rdma_latency_us)
            events.append(("kv_model_due", due))
        try:
            kv = await self._get_layer_kv(keys, None, self.cfg.layer_timeout_s, self._kv_device())
        except (BlockEvicted, BlockNotFound, RegionTimeout) as exc:
            raise KVUnavailable(f"request {req.request_id}: {n_full} blocks: "
                                f"{type(exc).__name__}: {exc}") from exc
        if modelled:
            await sleep_until(due)
        events.append(("kv_load_done", now()))
        self.metrics.add_bytes_moved(nbytes, transport="region" if modelled else "nixl",
                                     direction="get")

        async def get_layer(layer: int) -> Any:
            events.append((f"got_L{layer}", now()))
            return kv[layer]
        return get_layer

    async def generate_batched(self, req: DecodeRequest, past_len: int, get_layer: Any,
                               events: list[tuple[str, float]],
                               on_token: Any, eos: int | None, *,
                               reader_held: bool = False) -> None:
        """The request's generation in the worker's batch (``serving/batching.py``). Its layer
        reads start now (bounded by ``readers``; ``reader_held``: the caller holds its slot
        already, for a KV read whole before this); it joins a running batch once they are
        done, or at once, reading layer by layer, when nobody is decoding."""
        stream = get_layer if isinstance(get_layer, LayerStream) else None
        async with contextlib.nullcontext() if reader_held else self.readers:
            with contextlib.nullcontext() if reader_held else self._holding_kv():
                if stream is not None:
                    events.append(("early_reads", now()))
                    stream.start()
                    if self.cfg.first_pass == "extend":
                        await stream.all_read()
                await self.batcher.generate(
                    list(req.prompt_ids), get_layer=get_layer, past_len=past_len,
                    max_new_tokens=req.max_tokens, on_token=on_token, eos_token_id=eos,
                    layer_timeout=self.cfg.layer_timeout_s,
                    ready=(lambda: stream.settled) if stream is not None else None,
                    on_start=lambda: events.append(("decode_compute_start", now())))

    async def stream(self, req: DecodeRequest, resp: web.StreamResponse) -> None:
        """Generate and write NDJSON lines to ``resp`` (already prepared)."""
        from tract_async.serving.streaming import generate_streaming
        events: list[tuple[str, float]] = [("decode_recv", now())]
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        eos = self.model.config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0]

        def on_token(token: int) -> None:
            if not first_seen:
                first_seen.append(True)
                events.append(("first_token", now()))
            queue.put_nowait(token)

        first_seen: list[bool] = []

        async def generate() -> None:
            get_layer: Any = None
            try:
                past_len, get_layer = self.layer_source(req, events)
                if past_len and get_layer is None:
                    read = self.read_whole if self.cfg.mode in WHOLE_GET_MODES else self.read_http
                    if self.batcher is not None:
                        # the whole KV arrives before the compute: its reader slot is taken
                        # first, so that at most decode_batch + early_reads requests hold their
                        # KV in memory, as layer-streamed ones do (unbounded, a nixl decode
                        # worker whose gets took seconds ran out of GPU memory at 4.2 req/s:
                        # bench/results/gpu-20261207-s50, call 3)
                        async with self.readers:
                            with self._holding_kv():
                                get_layer = await read(req, events)
                                await self.generate_batched(req, past_len, get_layer, events,
                                                            on_token, eos, reader_held=True)
                        return
                    get_layer = await read(req, events)
                if self.batcher is not None:
                    await self.generate_batched(req, past_len, get_layer, events, on_token, eos)
                    return
                early = False
                if isinstance(get_layer, LayerStream) and not self.early.locked():
                    # read while waiting for the compute slot (EARLY_READS)
                    await self.early.acquire()
                    early = True
                    events.append(("early_reads", now()))
                    get_layer.start()
                try:
                    await self.compute.acquire()
                finally:
                    if early:
                        self.early.release()
                try:
                    events.append(("decode_compute_start", now()))
                    await generate_streaming(self.model, list(req.prompt_ids), get_layer=get_layer,
                                             past_len=past_len, max_new_tokens=req.max_tokens,
                                             on_token=on_token, eos_token_id=eos,
                                             layer_timeout=self.cfg.layer_timeout_s)
                finally:
                    self.compute.release()
            finally:
                if isinstance(get_layer, LayerStream):
                    await get_layer.aclose()
                queue.put_nowait(None)

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(generate())
                while (token := await queue.get()) is not None:
                    await resp.write(orjson.dumps({"token": token}) + b"\n")
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        events.append(("decode_done", now()))
        if self.gclog is not None:
            t0, t1 = events[0][1], events[-1][1]
            extra = self.gclog.events_between(t0, t1, prefix="d")
            if self.looplag is not None:
                extra += self.looplag.events_between(t0, t1, prefix="d")
            events[-1:-1] = extra
        await resp.write(orjson.dumps({"done": True, "events": events}) + b"\n")


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error a failed TaskGroup stands for: its first that is not a cancellation."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


DECODE_KEY = web.AppKey("decode_worker", DecodeWorker)


async def _resources(app: web.Application) -> AsyncIterator[None]:
    w = app[DECODE_KEY]
    cfg = w.cfg
    check_before_model(cfg)
    w.model = await asyncio.to_thread(load_model, cfg)
    w.layout = kv_layout(cfg, w.model)
    async with contextlib.AsyncExitStack() as stack:
        if cfg.decode_batch > 0:
            from tract_async.serving.batching import DecodeBatcher
            max_len = min(cfg.decode_max_len, w.model.config.max_position_embeddings)
            w.batcher = await asyncio.to_thread(DecodeBatcher, w.model,
                                                max_batch=cfg.decode_batch, max_len=max_len)
            # every graph before serving; the per-layer ones only where a request may stream
            await asyncio.to_thread(w.batcher.decoder.capture_all,
                                    stream=cfg.first_pass == "stream")
            stack.push_async_callback(w.batcher.aclose)
        if cfg.mode == "http":
            from tract_async.serving.http_kv import KVImporter
            from tract_async.transport.http import Agent
            secret = agent_secret()
            w.agent = Agent(f"decode-{cfg.node_id}", host=cfg.host, secret=secret,
                            allow_unauthenticated=secret is None)
            w.importer = KVImporter(w.agent, tasks=w.tasks)
            await w.agent.start()
            stack.push_async_callback(w.agent.close)
        elif cfg.mode in ENGINE_MODES:
            w.engine = await open_engine(cfg, w.layout)
            stack.push_async_callback(w.engine.close)
            if os.environ.get("TRACT_PHASES") == "1":   # dgc / dlag markers on the timeline
                w.gclog = GcLog(now).install()
                stack.callback(w.gclog.uninstall)
                w.looplag = LoopLag(now)
                w.tasks.spawn(w.looplag.run(), name="loop-lag")
        stack.push_async_callback(w.tasks.close)
        yield


async def handle_decode(request: web.Request) -> web.StreamResponse:
    w = request.app[DECODE_KEY]
    try:
        req = DecodeRequest.from_json(await request.json(), w.model.config.vocab_size)
    except (BadCompletionRequest, ValueError) as exc:
        w.metrics.count_request("error")
        return web.json_response(error_body(exc, 400), status=400)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    try:
        await w.stream(req, resp)
    except (TractError, ValueError) as exc:
        w.metrics.count_request("error")
        with contextlib.suppress(ConnectionError):
            await resp.write(orjson.dumps(error_body(exc, 500)) + b"\n")
        return resp
    except asyncio.CancelledError:
        w.metrics.count_request("cancelled")
        raise
    w.served += 1
    w.metrics.count_request("ok")
    await resp.write_eof()
    return resp


def build_app(cfg: ServiceConfig) -> web.Application:
    """The decode worker's application (the resources are built when it starts)."""
    return worker_app(cfg, "decode", DECODE_KEY, DecodeWorker(cfg), "/decode", handle_decode,
                      _resources)


def ready_info(app: web.Application) -> dict[str, Any]:
    return agent_ready_info(app[DECODE_KEY])


__all__ = ["DECODE_KEY", "DecodeWorker", "build_app", "ready_info"]
