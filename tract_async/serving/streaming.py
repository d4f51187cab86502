"""Async, layer-streaming prefill and decode: the forms the workers call from their event loop.

The model's forward pass is synchronous and, on a CPU, long enough (tens of milliseconds and up)
that running it on the event loop would stall everything else the worker's loop owns: the
engine's lock manager, heartbeats, HTTP handlers. So the compute runs in a worker thread and the
engine calls (``put_kv``/``get_kv``, which are coroutines) run on the loop; the two meet at layer
boundaries:

* :func:`prefill_streaming`: the thread computes layer after layer; after layer ``i``'s K/V
  projections it queues ``(i, kv_layer, ready)`` to the loop and continues with layer ``i``'s
  attention and layer ``i + 1`` without waiting. A consumer coroutine awaits
  ``put_layer(i, kv_layer, ready)`` in
  layer order, so layer ``i`` is being stored while layer ``i + 1`` computes (TraCT's layer
  streaming). The call returns once the compute is done *and* every put has completed.
* :func:`decode_streaming`: the first decode step reaches layer ``i``'s attention, asks the loop
  for ``await get_layer(i)`` and blocks (the thread, not the loop) until that layer's prompt KV is
  there. Layer 0 of the first step can thus run while the prefill worker is still producing the
  last layers. Later steps use the KV already gathered.

Failure and cancellation: if a put or get fails or times out, or the calling task is cancelled,
the thread is told to stop at its next layer boundary and the call waits until the thread has
actually stopped before it raises, so no compute keeps running, and no ``kv_layer`` is handed out,
behind the caller's back.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

from tract_async.extras import require

require("transformers", purpose="layer-streaming prefill and decode (tract_async.serving.streaming)")
from transformers import LlamaForCausalLM  # noqa: E402

from tract_async.serving.errors import KVShapeError, LayerWaitTimeout, NothingToCompute, TokenIdError
from tract_async.serving.kv_cache import build_cache, check_kv
from tract_async.serving.model import cache_kwargs
from tract_async.serving.model import PrefillResult, TokenIds, as_ids, greedy_continue, prefill

T = TypeVar("T")

#: ``put_layer(layer_index, kv_layer, ready)``: store one layer ``(2, new_tokens, kv_heads,
#: head_dim)``. For a CUDA ``kv_layer``, ``ready`` is a CUDA event recorded on the computing
#: thread's stream right after the layer's K/V were produced: work ordered after it sees the
#: layer complete, while an event recorded later on that stream also waits for the layers the
#: thread has queued since. None for CPU tensors.
PutLayer = Callable[[int, torch.Tensor, "torch.cuda.Event | None"], Awaitable[object]]
#: ``get_layer(layer_index)``: that layer's prompt KV ``(2, >= prompt_len, kv_heads, head_dim)``.
GetLayer = Callable[[int], Awaitable[torch.Tensor]]


class Aborted(Exception):
    """Raised inside a compute thread to unwind it; never escapes to a caller (this module
    and ``serving.batching`` turn it into a cancellation)."""


class Abort:
    """A stop flag shared by the loop and the compute thread, plus the loop futures the thread is
    blocked on, so that stopping also wakes a thread waiting for a layer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._waits: set[concurrent.futures.Future[torch.Tensor]] = set()

    def set(self) -> None:
        with self._lock:
            self._set = True
            waits = list(self._waits)
        for fut in waits:
            fut.cancel()

    def is_set(self) -> bool:
        return self._set

    def check(self) -> None:
        """Raise Aborted in the thread if the loop asked it to stop."""
        if self._set:
            raise Aborted()

    def submit(self, coro: Awaitable[torch.Tensor], loop: asyncio.AbstractEventLoop) -> torch.Tensor:
        """Run ``coro`` on ``loop`` and block this (non-loop) thread for its result."""
        with self._lock:
            if self._set:
                coro.close()  # type: ignore[attr-defined]
                raise Aborted()
            fut = asyncio.run_coroutine_threadsafe(coro, loop)  # type: ignore[arg-type]
            self._waits.add(fut)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise Aborted() from None
        finally:
            with self._lock:
                self._waits.discard(fut)


async def _run_in_thread(fn: Callable[[], T], abort: Abort) -> T:
    """Run ``fn`` in the loop's default executor; on cancellation, stop it and wait for it.

    Waiting matters: an abandoned thread would keep computing and, in prefill, keep producing
    layers for a request the caller has given up on.
    """
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, fn)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        abort.set()
        await asyncio.wait({fut})
        if not fut.cancelled():
            fut.exception()  # retrieved: the thread's Aborted is expected here
        raise


def _unwrap_group(group: BaseExceptionGroup) -> BaseException:
    """The error to raise for a failed TaskGroup: the first that is not our own unwinding.

    A put that fails makes the thread raise Aborted and the task group cancel; the caller wants
    the put's error, not the group.
    """
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _unwrap_group(exc)
        if not isinstance(exc, (Aborted, asyncio.CancelledError)):
            return exc
    return group.exceptions[0]


async def prefill_streaming(
    model: LlamaForCausalLM,
    input_ids: TokenIds,
    *,
    put_layer: PutLayer,
    past_kv: torch.Tensor | None = None,
    past_len: int | None = None,
    on_computed: Callable[[int], None] | None = None,
) -> PrefillResult:
    """:func:`~tract_async.serving.model.prefill` in a worker thread, storing layers as they come.

    ``put_layer(i, kv_layer, ready)`` is awaited on the loop for each layer in order,
    overlapping the compute of the following layers; ``kv_layer`` is a new tensor the callee may
    keep, ``ready`` its CUDA event (``PutLayer``). ``on_computed(i)`` (optional, for timelines)
    runs in the computing thread when layer ``i`` is handed to the loop: the gap from it to the
    put's start is the loop's, not the compute's. Returns after the compute and all puts are
    done.

    Raises:
        Whatever :func:`prefill` raises (TokenIdError, KVShapeError, NothingToCompute), and
        whatever ``put_layer`` raises: the first failing put stops the compute at its next layer.
    """
    loop = asyncio.get_running_loop()
    abort = Abort()
    queue: asyncio.Queue[tuple[int, torch.Tensor, torch.cuda.Event | None] | None] = asyncio.Queue()

    def on_layer(layer_index: int, kv_layer: torch.Tensor) -> None:
        abort.check()
        if on_computed is not None:
            on_computed(layer_index)
        ready = None
        if kv_layer.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kv_layer.device))   # this thread's stream
        loop.call_soon_threadsafe(queue.put_nowait, (layer_index, kv_layer, ready))

    def compute() -> PrefillResult:
        try:
            return prefill(model, input_ids, past_kv=past_kv, past_len=past_len, on_layer=on_layer)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    async def store() -> None:
        while (item := await queue.get()) is not None:
            try:
                await put_layer(*item)
            except BaseException:
                abort.set()
                raise

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(store())
            result = await _run_in_thread(compute, abort)
    except BaseExceptionGroup as group_error:
        raise _unwrap_group(group_error) from None
    return result


def layer_reader(
    model: LlamaForCausalLM,
    get_layer: GetLayer,
    past_len: int,
    layer_timeout: float | None,
) -> Callable[[int], Awaitable[torch.Tensor]]:
    """The loop-side ``await read(i)``: ``get_layer(i)`` under ``layer_timeout``, the tensor
    checked against the model's geometry and cut to the first ``past_len`` tokens."""
    cfg = model.config
    dtype = model.lm_head.weight.dtype

    async def read(layer_index: int) -> torch.Tensor:
        try:
            async with asyncio.timeout(layer_timeout):
                kv_layer = await get_layer(layer_index)
        except TimeoutError as exc:
            raise LayerWaitTimeout(
                f"layer {layer_index}: no KV within {layer_timeout} s"
            ) from exc
        if not isinstance(kv_layer, torch.Tensor):
            raise KVShapeError(f"get_layer({layer_index}) returned {type(kv_layer).__name__}, not a tensor")
        check_kv(kv_layer, num_layers=None, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                 dtype=dtype, min_tokens=past_len, what=f"get_layer({layer_index})")
        return kv_layer[:, :past_len]

    return read


def layer_fetcher(
    model: LlamaForCausalLM,
    get_layer: GetLayer,
    past_len: int,
    layer_timeout: float | None,
    abort: Abort,
    loop: asyncio.AbstractEventLoop,
) -> Callable[[int], torch.Tensor]:
    """The thread-side ``fetch(i)`` of a cache whose past arrives layer by layer: it runs
    :func:`layer_reader`'s ``read(i)`` on the loop and blocks the calling thread for it."""
    read = layer_reader(model, get_layer, past_len, layer_timeout)

    def fetch(layer_index: int) -> torch.Tensor:
        return abort.submit(read(layer_index), loop)

    return fetch


async def decode_streaming(
    model: LlamaForCausalLM,
    get_layer: GetLayer,
    prompt_len: int,
    first_token: int,
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    layer_timeout: float | None = None,
) -> list[int]:
    """Greedy decode whose first step awaits each layer's prompt KV just before that layer.

    ``get_layer(i)`` is awaited on the loop when the first step reaches layer ``i``'s attention,
    once per layer, in order; it returns ``(2, >= prompt_len, kv_heads, head_dim)`` (the first
    ``prompt_len`` tokens are used), typically ``await eng.get_kv(keys, layer=i, out=buf,
    timeout=...)`` where the engine waits for a layer still being produced. ``layer_timeout``
    bounds each ``get_layer`` here too. Returns the same tokens as
    :func:`~tract_async.serving.model.decode` (starting with ``first_token``).

    Raises:
        LayerWaitTimeout: a ``get_layer`` took longer than ``layer_timeout`` seconds.
        KVShapeError: a layer's KV does not match the model's geometry.
        TokenIdError: ``prompt_len`` is not positive or ``first_token`` is outside the vocabulary.
        ValueError: ``max_new_tokens`` is negative.
        Whatever ``get_layer`` raises.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg = model.config
    if prompt_len <= 0:
        raise TokenIdError(f"prompt_len must be positive, got {prompt_len}")
    if not 0 <= first_token < cfg.vocab_size:
        raise TokenIdError(f"first_token must be in [0, {cfg.vocab_size}), got {first_token}")
    if max_new_tokens == 0:
        return []
    loop = asyncio.get_running_loop()
    abort = Abort()
    fetch = layer_fetcher(model, get_layer, prompt_len, layer_timeout, abort, loop)

    def compute() -> list[int]:
        cache = build_cache(cfg.num_hidden_layers, pending_past_len=prompt_len, fetch=fetch)
        return greedy_continue(model, cache, first_token, max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id, should_stop=abort.check)

    try:
        return await _run_in_thread(compute, abort)
    except Aborted:
        # The thread only aborts when a fetch failed or we were cancelled; a cancellation is
        # re-raised by _run_in_thread itself, so reaching here means a fetch future was cancelled
        # from the outside (e.g. the loop is closing).
        raise asyncio.CancelledError() from None


def check_generation(model: LlamaForCausalLM, input_ids: TokenIds, past_len: int,
                     max_new_tokens: int) -> list[int]:
    """The prompt's ids, after the checks every generation with a transferred past makes.

    Raises:
        ValueError: ``max_new_tokens`` is negative.
        TokenIdError: bad prompt ids.
        NothingToCompute: ``past_len`` is outside ``[0, len(prompt))``: the last prompt token
            is always computed here, to produce the first generated token.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = as_ids(input_ids, model.config.vocab_size)
    if not 0 <= past_len < len(ids):
        raise NothingToCompute(f"past_len={past_len} must be in [0, {len(ids)}): the last prompt "
                               f"token is computed here to produce the first generated token")
    return ids


async def generate_streaming(
    model: LlamaForCausalLM,
    input_ids: TokenIds,
    *,
    get_layer: GetLayer,
    past_len: int,
    max_new_tokens: int,
    on_token: Callable[[int], object] | None = None,
    eos_token_id: int | None = None,
    layer_timeout: float | None = None,
) -> list[int]:
    """Greedy generation for a prompt whose first ``past_len`` tokens' KV arrive layer by layer.

    What a decode worker runs when only *full blocks* travel (only they have keys): the first
    forward pass computes the prompt tokens after ``past_len`` (the partial last block; at least
    the last token, whose logits give the first generated token), and its layer ``i`` awaits
    ``get_layer(i)`` (``(2, >= past_len, kv_heads, head_dim)``) just before that layer's
    attention, so it overlaps a prefill still producing later layers. The following steps are
    plain greedy decode. ``on_token(token)`` is called on the loop as soon as each token exists
    (the first one included), so a server can stream it while the next step computes. With
    ``past_len == 0`` the whole prompt is computed here and ``get_layer`` is never called.

    Returns the generated tokens (the first one included), as
    :func:`~tract_async.serving.model.reference_generate` does for the same prompt.

    Raises:
        NothingToCompute: ``past_len >= len(prompt)``; at least the last token is computed here.
        TokenIdError: bad prompt ids.
        LayerWaitTimeout, KVShapeError, ValueError, and whatever ``get_layer`` raises, as
        :func:`decode_streaming`.
    """
    ids = check_generation(model, input_ids, past_len, max_new_tokens)
    if max_new_tokens == 0:
        return []
    loop = asyncio.get_running_loop()
    abort = Abort()
    num_layers = model.config.num_hidden_layers
    device = model.lm_head.weight.device
    if past_len > 0:
        fetch = layer_fetcher(model, get_layer, past_len, layer_timeout, abort, loop)
        cache = build_cache(num_layers, pending_past_len=past_len, fetch=fetch)
    else:
        cache = build_cache(num_layers)

    def emit(token: int) -> None:
        if on_token is not None:
            loop.call_soon_threadsafe(on_token, token)

    def compute() -> list[int]:
        tail = torch.tensor([ids[past_len:]], dtype=torch.long, device=device)
        with torch.no_grad():
            out = model(input_ids=tail, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        first = int(torch.argmax(out.logits[0, -1]))
        emit(first)
        return greedy_continue(model, cache, first, max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id, should_stop=abort.check, on_token=emit)

    try:
        return await _run_in_thread(compute, abort)
    except Aborted:
        raise asyncio.CancelledError() from None
