"""What the router, the prefill worker and the decode worker say to each other, and to clients.

Client-facing: an OpenAI-style ``POST /v1/completions``. ``prompt`` is a string (encoded with the
built-in byte tokenizer) or a list of token ids; ``max_tokens``, ``stream`` and ``model`` as
OpenAI; greedy decoding only (``temperature`` other than 0 is refused rather than ignored). The
reply is a ``text_completion`` object (or, streaming, Server-Sent Events of
``text_completion`` chunks ending with ``data: [DONE]``), with two additions every client may
ignore: ``choices[i].token_ids`` (the generated ids, which the byte-level text cannot always
represent) and a ``tract`` object with the request's timing breakdown.

Between the services (JSON over HTTP on the rack network, one request per client request):

* router -> prefill ``POST /prefill`` :class:`PrefillRequest` -> :class:`PrefillReply`;
* router -> decode ``POST /decode`` :class:`DecodeRequest` -> NDJSON lines, one
  ``{"token": id}`` per generated token as soon as it exists, then one
  ``{"done": true, "timings": {...}}`` (or ``{"error": {"type": ..., "message": ...}}``).

Timings are *events*: ``[name, t]`` pairs where ``t`` is ``time.monotonic()`` of the process
that saw the event. On Linux that clock (CLOCK_MONOTONIC) is one per host, so the router can
place every service's events on its own time line when all run on one host (the demo); across
hosts only the durations inside one service are meaningful.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from tract_async.serving.errors import BadCompletionRequest
from tract_async.serving.tokenizer import ByteTokenizer

#: Transports of one run: the HTTP agent (baseline), the region without and with prefix cache.
MODES: tuple[str, ...] = ("http", "region-transfer", "region-cache")
#: Every mode a rack can serve in: ``MODES`` (what ``tract demo`` compares) and two baselines of
#: the load benchmark (``tract bench serve``): ``recompute`` (no transfer: the decode worker
#: computes the whole prompt itself) and ``rdma-model`` (the KV moves through the region once
#: the prefill is done, and its arrival is held back to what an RDMA NIC would take:
#: :mod:`tract_async.serving.rdma_model`; a model, not a measurement).
SERVING_MODES: tuple[str, ...] = (*MODES, "recompute", "rdma-model", "nixl")
#: Modes whose KV travels through a shared region (the workers need ``--region``).
REGION_MODES: tuple[str, ...] = ("region-transfer", "region-cache", "rdma-model")
#: Modes whose KV travels over the network between the workers' engines (no region): ``nixl``,
#: the paper's baseline (NIXL over UCX; the harness picks the UCX transports with ``UCX_TLS``).
#: As the NIXL connectors of vLLM and Dynamo do, the prefill's engine holds each request's whole
#: KV in its pool (GPU memory on a GPU) once the prompt is computed, and the decode's engine,
#: which names it as its peer, then pulls every layer in one get (NIXL READs).
NET_MODES: tuple[str, ...] = ("nixl",)
#: Modes whose workers move KV through an Engine (``put_kv`` / ``get_kv`` by layer).
ENGINE_MODES: tuple[str, ...] = (*REGION_MODES, *NET_MODES)
#: Modes where the router starts decode only after the prefill has answered (the KV can only be
#: fetched once it is complete), instead of both at once with layer streaming.
SEQUENTIAL_MODES: tuple[str, ...] = ("http", "rdma-model", "nixl")
#: Modes whose block keys are salted with the request id: each request's KV is its own, never a
#: prefix another request could find.
SALTED_MODES: tuple[str, ...] = ("region-transfer", "rdma-model", "nixl")
ROLES: tuple[str, ...] = ("prefill", "decode", "router")
#: The line a service prints on stdout once it listens: ``TRACT-READY {json}``.
READY_PREFIX = "TRACT-READY "
#: Environment variable carrying the agents' shared HMAC secret (hex), never the command line.
SECRET_ENV = "TRACT_AGENT_SECRET"

MAX_PROMPT_TOKENS = 1 << 17
MAX_NEW_TOKENS = 4096


def now() -> float:
    """The event clock (see the module docstring)."""
    return time.monotonic()


def engine_mode(mode: str) -> str:
    """EngineConfig.mode for a region or network run mode (``ENGINE_MODES``).

    rdma-model runs the engine in cache mode (with salted keys, so nothing is shared): a
    transfer-mode get frees the blocks it consumed under the global lock, and under load that
    lock wait (milliseconds on a busy 2-core host) would count as the modelled NIC's time;
    a cache-mode get takes no lock. Its blocks leave by LRU eviction instead.
    """
    return {"region-transfer": "transfer", "region-cache": "cache", "rdma-model": "cache",
            "nixl": "transfer"}[mode]


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


# --- client-facing ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request."""

    request_id: str
    model: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    echo_prompt_text: bool = False


def _int_list(value: Any, what: str, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise BadCompletionRequest(f"{what} must be a non-empty list of token ids")
    if len(value) > MAX_PROMPT_TOKENS:
        raise BadCompletionRequest(f"{what} has {len(value)} tokens; at most {MAX_PROMPT_TOKENS}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise BadCompletionRequest(f"{what} must hold ints in [0, {vocab_size}), got {t!r}")
    return tuple(value)


def parse_completion(body: Any, *, vocab_size: int, tokenizer: ByteTokenizer | None = None,
                     default_model: str = "tract") -> CompletionRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        BadCompletionRequest: not an object; no prompt, or a prompt that is neither a string nor
            a list of ids in the vocabulary (a batch of prompts is refused); ``max_tokens`` not in
            1..4096; ``stream`` not a bool; ``n`` != 1; a sampling ``temperature`` != 0.
    """
    if not isinstance(body, Mapping):
        raise BadCompletionRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadCompletionRequest("this server takes token ids only (prompt: [ids])")
        ids = tuple(tokenizer.encode(prompt))
        if any(t >= vocab_size for t in ids):
            raise BadCompletionRequest("the tokenizer's ids exceed the model's vocabulary")
        if not ids:
            raise BadCompletionRequest("prompt is empty")
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        raise BadCompletionRequest("batched prompts are not supported: send one prompt per request")
    else:
        ids = _int_list(prompt, "prompt", vocab_size)
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise BadCompletionRequest(f"max_tokens must be an int in [1, {MAX_NEW_TOKENS}], got {max_tokens!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadCompletionRequest(f"stream must be a bool, got {stream!r}")
    if body.get("n", 1) != 1:
        raise BadCompletionRequest("n must be 1")
    temperature = body.get("temperature", 0)
    if temperature not in (0, 0.0, None):
        raise BadCompletionRequest("only greedy decoding is served: temperature must be 0")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise BadCompletionRequest("model must be a string")
    return CompletionRequest(request_id=new_request_id(), model=model, prompt_ids=ids,
                             max_tokens=max_tokens, stream=stream)


def completion_body(req: CompletionRequest, tokens: Sequence[int], finish_reason: str, *,
                    tokenizer: ByteTokenizer, cached_tokens: int, tract: dict[str, Any]) -> dict[str, Any]:
    """The non-streaming ``text_completion`` reply."""
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [{"index": 0, "text": _text(tokenizer, tokens), "token_ids": list(tokens),
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(tokens),
                  "total_tokens": len(req.prompt_ids) + len(tokens),
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
        "tract": tract,
    }


def completion_chunk(req: CompletionRequest, tokens: Sequence[int], finish_reason: str | None, *,
                     tokenizer: ByteTokenizer, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk (the SSE ``data:`` payload)."""
    chunk: dict[str, Any] = {
        "id": req.request_id, "object": "text_completion", "created": int(time.time()),
        "model": req.model,
        "choices": [{"index": 0, "text": _text(tokenizer, tokens), "token_ids": list(tokens),
                     "logprobs": None, "finish_reason": finish_reason}],
    }
    if extra:
        chunk.update(extra)
    return chunk


def _text(tokenizer: ByteTokenizer, tokens: Sequence[int]) -> str:
    # Token by token, a multi-byte character splits across chunks: the text is best effort,
    # token_ids are exact.
    return tokenizer.decode(t for t in tokens if t < 256 or t in tokenizer.special_ids)


def error_body(exc: BaseException, status: int) -> dict[str, Any]:
    """OpenAI-style error object."""
    return {"error": {"type": type(exc).__name__, "message": str(exc), "code": status}}


# --- between services -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    kv_consumer: str | None = None   # http mode: the agent name that will READ the KV

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_ids),
                "kv_consumer": self.kv_consumer}

    @classmethod
    def from_json(cls, body: Any, vocab_size: int) -> PrefillRequest:
        """Raises BadCompletionRequest."""
        if not isinstance(body, Mapping) or not isinstance(body.get("request_id"), str):
            raise BadCompletionRequest("prefill request needs request_id and prompt_token_ids")
        consumer = body.get("kv_consumer")
        if consumer is not None and not isinstance(consumer, str):
            raise BadCompletionRequest("kv_consumer must be a string")
        return cls(request_id=body["request_id"],
                   prompt_ids=_int_list(body.get("prompt_token_ids"), "prompt_token_ids", vocab_size),
                   kv_consumer=consumer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVSource:
    """HTTP mode: where the decode worker READs the prompt's full-block KV from."""
    agent: str            # the prefill worker's agent name
    agent_url: str        # its agent server (metadata is fetched once per agent)
    desc: tuple[int, int, int]   # (addr, nbytes, dev_id) inside the agent's registered pool
    tokens: int           # tokens of KV the descriptor holds (full blocks)

    def to_json(self) -> dict[str, Any]:
        return {"agent": self.agent, "agent_url": self.agent_url, "desc": list(self.desc),
                "tokens": self.tokens}

    @classmethod
    def from_json(cls, body: Any) -> KVSource:
        """Raises BadCompletionRequest."""
        try:
            desc = tuple(int(x) for x in body["desc"])
            if len(desc) != 3:
                raise ValueError("desc needs 3 fields")
            return cls(agent=str(body["agent"]), agent_url=str(body["agent_url"]),
                       desc=desc, tokens=int(body["tokens"]))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise BadCompletionRequest(f"bad kv_source: {exc}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillReply:
    request_id: str
    first_token: int
    prompt_tokens: int
    full_blocks: int
    hit_blocks: int
    computed_tokens: int
    kv_bytes: int
    kv_source: KVSource | None
    events: list[tuple[str, float]]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kv_source"] = self.kv_source.to_json() if self.kv_source else None
        d["events"] = [list(e) for e in self.events]
        return d

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PrefillReply:
        src = body.get("kv_source")
        return cls(request_id=body["request_id"], first_token=int(body["first_token"]),
                   prompt_tokens=int(body["prompt_tokens"]), full_blocks=int(body["full_blocks"]),
                   hit_blocks=int(body["hit_blocks"]), computed_tokens=int(body["computed_tokens"]),
                   kv_bytes=int(body["kv_bytes"]),
                   kv_source=KVSource.from_json(src) if src else None,
                   events=[(str(n), float(t)) for n, t in body.get("events", [])])


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    kv_source: KVSource | None = None

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_ids),
                "max_tokens": self.max_tokens,
                "kv_source": self.kv_source.to_json() if self.kv_source else None}

    @classmethod
    def from_json(cls, body: Any, vocab_size: int) -> DecodeRequest:
        """Raises BadCompletionRequest."""
        if not isinstance(body, Mapping) or not isinstance(body.get("request_id"), str):
            raise BadCompletionRequest("decode request needs request_id, prompt_token_ids, max_tokens")
        mt = body.get("max_tokens")
        if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= MAX_NEW_TOKENS:
            raise BadCompletionRequest(f"max_tokens must be in [1, {MAX_NEW_TOKENS}]")
        src = body.get("kv_source")
        return cls(request_id=body["request_id"],
                   prompt_ids=_int_list(body.get("prompt_token_ids"), "prompt_token_ids", vocab_size),
                   max_tokens=mt, kv_source=KVSource.from_json(src) if src else None)


def full_blocks(prompt_len: int, block_tokens: int) -> int:
    """Blocks with a key: the full ones."""
    return prompt_len // block_tokens


def decode_past_len(prompt_len: int, block_tokens: int) -> int:
    """Prompt tokens whose KV the decode worker receives: every full block, but never the last
    token (its logits give the first generated token, so it is computed at decode)."""
    return min(full_blocks(prompt_len, block_tokens) * block_tokens, prompt_len - 1)
