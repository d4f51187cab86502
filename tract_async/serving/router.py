"""The router: OpenAI-style ``POST /v1/completions`` over a prefill and a decode worker.

As vLLM's disaggregated proxy does, each request goes to the prefill worker and then to the
decode worker, whose tokens are streamed back to the client. When the two start depends on the
transport:

* region modes: both at once. The decode worker's first forward pass waits in the region for
  each layer of the prompt's KV as the prefill worker puts it, so the transfer of layer ``i``
  overlaps the compute of layer ``i + 1`` and decode's own compute;
* http and rdma-model: decode starts when the prefill has answered (with the descriptor of its
  KV for http: the bytes can only be READ once they are all there);
* recompute: the prefill worker is not called; the decode worker computes the whole prompt.

TTFT is measured here, from the moment the request arrives to the moment the first token has
been written to the client (streaming; without streaming, the whole reply). The reply's ``tract``
object carries the breakdown: every worker event placed on the router's time line, in ms.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tract_async.serving.errors import BadCompletionRequest, KVPoolFull, UpstreamFailed
from tract_async.serving.metrics import ServiceMetrics, metrics_handler
from tract_async.serving.protocol import (SEQUENTIAL_MODES, CompletionRequest, DecodeRequest,
                                          PrefillReply, PrefillRequest, completion_body,
                                          completion_chunk, error_body, now, parse_completion)
from tract_async.serving.service import ServiceConfig
from tract_async.serving.tokenizer import ByteTokenizer

VOCAB = {"tiny": 259, "llama3-8b": 128256}


class Router:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.metrics = ServiceMetrics("router", role="router")
        self.tokenizer = ByteTokenizer()
        self.session: aiohttp.ClientSession | None = None
        self.decode_agent: str | None = None
        self.served = 0

    @property
    def vocab_size(self) -> int:
        return VOCAB[self.cfg.model]

    async def _json(self, method: str, url: str, body: Any = None, *, timeout: float) -> Any:
        assert self.session is not None, "router: session used outside the app's lifetime"
        try:
            async with self.session.request(method, url, json=body,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise _upstream_error(url, r.status, data)
                return data
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise UpstreamFailed(f"{method} {url}: {type(exc).__name__}: {exc}") from exc

    async def prefill(self, req: CompletionRequest) -> PrefillReply:
        preq = PrefillRequest(request_id=req.request_id, prompt_ids=req.prompt_ids,
                              kv_consumer=self.decode_agent)
        data = await self._json("POST", f"{self.cfg.prefill_url}/prefill", preq.to_json(),
                                timeout=self.cfg.request_timeout_s)
        return PrefillReply.from_json(data)

    async def decode(self, dreq: DecodeRequest, done: dict[str, Any]) -> AsyncIterator[int]:
        """Tokens from the decode worker as they come; its final line lands in ``done``."""
        assert self.session is not None, "router: session used outside the app's lifetime"
        url = f"{self.cfg.decode_url}/decode"
        try:
            async with self.session.post(url, json=dreq.to_json(),
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)) as r:
                if r.status != 200:
                    raise _upstream_error(url, r.status, await r.json(content_type=None))
                async for line in r.content:
                    msg = orjson.loads(line)
                    if "token" in msg:
                        yield int(msg["token"])
                    elif "error" in msg:
                        raise _upstream_error(url, 500, msg)
                    elif msg.get("done"):
                        done.update(msg)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise UpstreamFailed(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if not done:
            raise UpstreamFailed(f"POST {url}: the stream ended without its final line")

    async def complete(self, request: web.Request, req: CompletionRequest, t0: float) -> web.StreamResponse:
        """Run one request through prefill and decode, writing the reply to the client."""
        tokens: list[int] = []
        decode_done: dict[str, Any] = {}
        prefill_box: list[PrefillReply] = []
        resp: web.StreamResponse | None = None
        ttft: float | None = None

        async def run_prefill() -> PrefillReply:
            reply = await self.prefill(req)
            prefill_box.append(reply)
            return reply

        async def run_decode(kv_source: Any) -> None:
            nonlocal resp, ttft
            dreq = DecodeRequest(request_id=req.request_id, prompt_ids=req.prompt_ids,
                                 max_tokens=req.max_tokens, kv_source=kv_source)
            async for tok in self.decode(dreq, decode_done):
                tokens.append(tok)
                if req.stream:
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                        await resp.prepare(request)
                    chunk = completion_chunk(req, [tok], None, tokenizer=self.tokenizer)
                    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if ttft is None and req.stream:
                    ttft = now() - t0
                    self.metrics.observe_ttft(ttft)

        failure: BaseException | None = None
        try:
            if self.cfg.mode == "recompute":
                await run_decode(None)
                n_full = len(req.prompt_ids) // self.cfg.block_tokens
                prefill_box.append(PrefillReply(
                    request_id=req.request_id, first_token=-1, prompt_tokens=len(req.prompt_ids),
                    full_blocks=n_full, hit_blocks=0, computed_tokens=0, kv_bytes=0,
                    kv_source=None, events=[]))
            elif self.cfg.mode in SEQUENTIAL_MODES:
                reply = await run_prefill()
                await run_decode(reply.kv_source)
            else:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(run_prefill())
                    tg.create_task(run_decode(None))
        except BaseExceptionGroup as group:
            from tract_async.serving.decode_worker import first_error
            failure = first_error(group)
        except (UpstreamFailed, KVPoolFull) as exc:
            failure = exc
        if failure is not None:
            if resp is None or isinstance(failure, asyncio.CancelledError):
                raise failure
            # the stream has started: the error goes in-band, as an SSE event
            self.metrics.count_request("error")
            with contextlib.suppress(ConnectionError):
                await resp.write(b"data: " + orjson.dumps(error_body(failure, 502)) + b"\n\n")
                await resp.write_eof()
            return resp
        pre = prefill_box[0]
        eos = 257 if self.cfg.model == "tiny" else 128001
        finish = "stop" if tokens and tokens[-1] == eos else "length"
        tract = self._breakdown(t0, pre, decode_done, ttft)
        self.served += 1
        self.metrics.count_request("ok")
        self.metrics.add_prefix_hit_blocks(pre.hit_blocks)
        if self.cfg.mode != "recompute":
            self.metrics.add_bytes_moved(pre.kv_bytes, transport="http" if self.cfg.mode == "http"
                                         else "region", direction="put")
        if req.stream:
            if resp is None:   # no token at all (cannot happen with max_tokens >= 1)
                raise UpstreamFailed("the decode worker produced no token")
            tract["e2e_ms"] = (now() - t0) * 1e3
            last = completion_chunk(req, [], finish, tokenizer=self.tokenizer, extra={"tract": tract})
            await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        ttft = now() - t0
        self.metrics.observe_ttft(ttft)
        tract["ttft_ms"] = tract["e2e_ms"] = ttft * 1e3
        body = completion_body(req, tokens, finish, tokenizer=self.tokenizer,
                               cached_tokens=pre.hit_blocks * self.cfg.block_tokens, tract=tract)
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def _breakdown(self, t0: float, pre: PrefillReply, decode_done: dict[str, Any],
                   ttft: float | None) -> dict[str, Any]:
        events = {name: round((t - t0) * 1e3, 3) for name, t in pre.events}
        events.update({name: round((float(t) - t0) * 1e3, 3)
                       for name, t in decode_done.get("events", [])})
        return {"mode": self.cfg.mode, "ttft_ms": None if ttft is None else ttft * 1e3,
                "prompt_tokens": pre.prompt_tokens, "full_blocks": pre.full_blocks,
                "hit_blocks": pre.hit_blocks, "computed_tokens": pre.computed_tokens,
                "kv_bytes": pre.kv_bytes, "prefill_first_token": pre.first_token,
                "events_ms": dict(sorted(events.items(), key=lambda kv: kv[1]))}


def _upstream_error(url: str, status: int, data: Any) -> Exception:
    err = data.get("error", {}) if isinstance(data, dict) else {}
    kind, msg = err.get("type", "?"), err.get("message", str(data)[:200])
    if kind == "KVPoolFull":
        return KVPoolFull(f"{url}: {msg}")
    return UpstreamFailed(f"{url} answered {status}: {kind}: {msg}")


ROUTER_KEY = web.AppKey("router", Router)


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    r = app[ROUTER_KEY]
    connector = aiohttp.TCPConnector(limit=64, limit_per_host=32)
    async with aiohttp.ClientSession(connector=connector) as session:
        r.session = session
        if r.cfg.mode == "http":   # the decode worker's agent name, for the prefill's release wait
            health = await r._json("GET", f"{r.cfg.decode_url}/health", timeout=r.cfg.request_timeout_s)
            r.decode_agent = health.get("agent")
        yield
        r.session = None


async def handle_completions(request: web.Request) -> web.StreamResponse:
    t0 = now()
    r = request.app[ROUTER_KEY]
    try:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise BadCompletionRequest(f"the body is not JSON: {exc}") from None
        req = parse_completion(body, vocab_size=r.vocab_size, tokenizer=r.tokenizer,
                               default_model=r.cfg.model)
        return await r.complete(request, req, t0)
    except BadCompletionRequest as exc:
        return _fail(r, exc, 400)
    except KVPoolFull as exc:
        return _fail(r, exc, 503)
    except UpstreamFailed as exc:
        return _fail(r, exc, 502)
    except asyncio.CancelledError:
        r.metrics.count_request("cancelled")
        raise


def _fail(r: Router, exc: Exception, status: int) -> web.Response:
    r.metrics.count_request("error")
    return web.json_response(error_body(exc, status), status=status)


async def handle_health(request: web.Request) -> web.Response:
    r = request.app[ROUTER_KEY]
    return web.json_response({"role": "router", "mode": r.cfg.mode, "served": r.served,
                              "prefill_url": r.cfg.prefill_url, "decode_url": r.cfg.decode_url})


def build_app(cfg: ServiceConfig) -> web.Application:
    if cfg.role != "router":
        raise ValueError(f"build_app for the router got role {cfg.role!r}")
    app = web.Application(client_max_size=16 << 20)
    r = Router(cfg)
    app[ROUTER_KEY] = r
    app.cleanup_ctx.append(_session_ctx)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", metrics_handler(r.metrics))
    return app


def ready_info(app: web.Application) -> dict[str, Any]:
    return {}


__all__ = ["ROUTER_KEY", "Router", "build_app", "ready_info"]
