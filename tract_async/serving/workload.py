"""A multi-turn chat workload, the client that drives it, and its statistics.

The workload is what makes a prefix cache pay: every conversation starts with the same system
prompt, and each turn's prompt is the previous turn's prompt plus the model's reply and the next
user message. The history is kept in token ids (the model's reply ids are appended as they are:
a random-weight model emits bytes that are not valid UTF-8, and a text round trip would change
them and break the prefix). The template is :func:`~tract_async.serving.tokenizer.render_chat`'s.

The client speaks only the public API: streaming ``POST /v1/completions`` with token ids.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
import orjson

from tract_async.serving.errors import UpstreamFailed
from tract_async.serving.tokenizer import ByteTokenizer

_WORDS = ("rack memory block layer prefix cache decode prefill token region transfer shared "
          "latency stream node lock index key value head batch model query answer").split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatWorkload:
    """``conversations`` chats of ``turns`` turns each, sharing one system prompt."""
    conversations: int = 4
    turns: int = 4
    system_chars: int = 600
    user_chars: int = 160
    max_new_tokens: int = 8
    seed: int = 0

    def system_prompt(self) -> str:
        rng = random.Random(f"system/{self.seed}")
        text = "You are the assistant of a rack-scale serving demo."
        while len(text) < self.system_chars:
            text += " " + _sentence(rng, 8)
        return text[:self.system_chars]

    def user_message(self, conversation: int, turn: int) -> str:
        rng = random.Random(f"user/{self.seed}/{conversation}/{turn}")
        text = f"Chat {conversation}, turn {turn}:"
        while len(text) < self.user_chars:
            text += " " + _sentence(rng, 6)
        return text[:self.user_chars]


class Conversation:
    """The token-id history of one chat; ``prompt()`` is the next request's prompt."""

    def __init__(self, workload: ChatWorkload, index: int, tokenizer: ByteTokenizer | None = None) -> None:
        self.workload = workload
        self.index = index
        self.tok = tokenizer or ByteTokenizer()
        self.turn = 0
        sys_part = f"<|system|>\n{workload.system_prompt()}<|end|>\n"
        self.ids: list[int] = self.tok.encode(sys_part) + self._user(0)

    def _user(self, turn: int) -> list[int]:
        msg = self.workload.user_message(self.index, turn)
        return self.tok.encode(f"<|user|>\n{msg}<|end|>\n<|assistant|>\n", add_bos=False)

    def prompt(self) -> list[int]:
        return list(self.ids)

    def add_reply(self, reply_ids: Sequence[int]) -> None:
        """Append the reply and the next user turn."""
        self.turn += 1
        self.ids += list(reply_ids) + self.tok.encode("<|end|>\n", add_bos=False) + self._user(self.turn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    token_ids: tuple[int, ...]
    ttft_ms: float            # the router's: arrival to first token written to the client
    client_ttft_ms: float     # seen by this client: request sent to first chunk received
    e2e_ms: float
    hit_blocks: int
    full_blocks: int
    kv_bytes: int
    events_ms: dict[str, float]


class StreamCutShort(UpstreamFailed):
    """A streaming completion ended without its ``data: [DONE]``."""


async def completion_messages(r: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The parsed events of a streaming ``/v1/completions`` response, in order, up to its
    ``data: [DONE]`` (which ends the iteration). The one reader of the router's server-sent
    events for every client here (this module's, the load generator's).

    Raises StreamCutShort: the stream ended without ``[DONE]``; ValueError: an event that is
    not JSON. An in-band error event is yielded like any other (``"error"`` in it)."""
    async for raw in r.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            return
        yield orjson.loads(data)
    raise StreamCutShort("the stream ended without data: [DONE]")


async def complete_streaming(session: aiohttp.ClientSession, url: str, prompt_ids: Sequence[int],
                             max_tokens: int, *, timeout: float = 120.0) -> tuple[list[int], float, dict[str, Any]]:
    """One streaming completion: ``(token_ids, client_ttft_s, tract_breakdown)``.

    Raises UpstreamFailed: an HTTP error, an in-band error event, or a stream without its end.
    """
    t0 = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    tract: dict[str, Any] = {}
    body = {"prompt": list(prompt_ids), "max_tokens": max_tokens, "stream": True, "temperature": 0}
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                raise UpstreamFailed(f"router answered {r.status}: {(await r.text())[:300]}")
            async for msg in completion_messages(r):
                if "error" in msg:
                    raise UpstreamFailed(f"router stream error: {msg['error']}")
                ids = msg["choices"][0].get("token_ids", [])
                if ids and first is None:
                    first = time.perf_counter()
                tokens += ids
                tract = msg.get("tract", tract)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamFailed(f"POST {url}/v1/completions: {type(exc).__name__}: {exc}") from exc
    return tokens, (first or time.perf_counter()) - t0, tract


async def run_chat_workload(url: str, workload: ChatWorkload, *, concurrency: int = 1,
                            on_result: Callable[[TurnResult], None] | None = None,
                            timeout: float = 120.0) -> list[TurnResult]:
    """Run every conversation (turns in order; up to ``concurrency`` conversations at once)."""
    results: list[TurnResult] = []
    gate = asyncio.Semaphore(max(1, concurrency))

    async def chat(session: aiohttp.ClientSession, index: int) -> None:
        conv = Conversation(workload, index)
        async with gate:
            for turn in range(workload.turns):
                prompt = conv.prompt()
                ids, client_ttft, tract = await complete_streaming(
                    session, url, prompt, workload.max_new_tokens, timeout=timeout)
                res = TurnResult(conversation=index, turn=turn, prompt_tokens=len(prompt),
                                 token_ids=tuple(ids), ttft_ms=float(tract.get("ttft_ms") or 0.0),
                                 client_ttft_ms=client_ttft * 1e3,
                                 e2e_ms=float(tract.get("e2e_ms") or 0.0),
                                 hit_blocks=int(tract.get("hit_blocks", 0)),
                                 full_blocks=int(tract.get("full_blocks", 0)),
                                 kv_bytes=int(tract.get("kv_bytes", 0)),
                                 events_ms=dict(tract.get("events_ms", {})))
                results.append(res)
                if on_result is not None:
                    on_result(res)
                conv.add_reply(ids)

    async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tg:
        for i in range(workload.conversations):
            tg.create_task(chat(session, i))
    return sorted(results, key=lambda r: (r.conversation, r.turn))


# --- statistics ---------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: Sequence[TurnResult]) -> dict[str, Any]:
    ttft = [r.ttft_ms for r in results]
    full = sum(r.full_blocks for r in results)
    return {"requests": len(results),
            "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else math.nan,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "client_ttft_mean_ms": (sum(r.client_ttft_ms for r in results) / len(results)
                                    if results else math.nan),
            "e2e_mean_ms": sum(r.e2e_ms for r in results) / len(results) if results else math.nan,
            "hit_rate": sum(r.hit_blocks for r in results) / full if full else 0.0,
            "kv_mib": sum(r.kv_bytes for r in results) / (1 << 20)}


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    head = (f"{'mode':<16} {'reqs':>4} {'TTFT mean':>10} {'p50':>9} {'p99':>9} {'hit rate':>9} "
            f"{'e2e mean':>9} {'KV moved':>9}")
    lines = [head, "-" * len(head)]
    for mode, s in summaries.items():
        lines.append(f"{mode:<16} {s['requests']:>4} {s['ttft_mean_ms']:>8.1f}ms "
                     f"{s['ttft_p50_ms']:>7.1f}ms {s['ttft_p99_ms']:>7.1f}ms {s['hit_rate']:>8.0%} "
                     f"{s['e2e_mean_ms']:>7.1f}ms {s['kv_mib']:>6.1f}MiB")
    return "\n".join(lines)


def layer_timeline(events_ms: dict[str, float]) -> str:
    """One line showing layer streaming: when prefill put and decode got each layer."""
    puts = [v for k, v in sorted(events_ms.items(), key=lambda kv: kv[1]) if k.startswith("put_L")]
    gots = [v for k, v in sorted(events_ms.items(), key=lambda kv: kv[1]) if k.startswith("got_L")]
    parts = []
    if puts:
        parts.append("prefill put L0..L%d at %s ms" % (len(puts) - 1, "/".join(f"{v:.1f}" for v in puts)))
    if "http_read_done" in events_ms:
        parts.append(f"HTTP READ done at {events_ms['http_read_done']:.1f} ms")
    if gots:
        parts.append("decode got L0..L%d at %s ms" % (len(gots) - 1, "/".join(f"{v:.1f}" for v in gots)))
    if "first_token" in events_ms:
        parts.append(f"first token at {events_ms['first_token']:.1f} ms")
    return "; ".join(parts)


def plot_cdf(ttfts_ms: dict[str, Sequence[float]], path: str, *, title: str = "TTFT CDF") -> None:
    """TTFT CDF per mode as a PNG (matplotlib, Agg backend: no display needed)."""
    from tract_async.extras import require
    matplotlib = require("matplotlib", purpose="the TTFT CDF plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for mode, values in ttfts_ms.items():
        xs = sorted(values)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=mode)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
