"""Continuous batching of a simple kind: one compute thread decodes every request of a worker.

A decode worker used to give its compute to one request at a time: a request arriving while
another generated waited for the whole generation (on the H100 serving run of 2026-12-06 the
queue was 0.8-1.4 s of a 1.7-2.3 s TTFT, ``bench/results/gpu-20261206-s38``), and the wait hid
what the KV transfer costs. Here each request's *first* forward pass (the prompt tokens after the
transferred blocks, whose layers wait for the KV as before) runs alone, and every later step runs
for all admitted requests at once (:class:`~tract_async.serving.fast_decode.BatchDecoder`):

* **admission**: pending requests in arrival order, while slots are free. With nobody decoding,
  the head request's first pass starts at once and waits layer by layer for KV still being
  produced (the layer pipelining of ``streaming.generate_streaming``). With a batch running, a
  request is admitted only once ``ready()`` says its KV is in hand (its layer reads finished), so
  a prefill still producing layers never stalls the requests that are generating.
* **steps**: one batched greedy step; each token goes to its request's ``on_token`` on the
  event loop as soon as the step ends; a request leaves at its last token, its EOS or its
  cancellation, and its slot is refilled.
* A request longer than the decoder's ``max_len`` runs transformers' own step, alone, when no
  batch is running (correct, slower; ``ServiceConfig.decode_max_len`` sizes the slots).

The thread is the only caller of the model and the decoder; the loop side only queues work and
awaits futures, so nothing here blocks the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import torch

from tract_async.serving.fast_decode import EXTEND_BUCKETS, BatchDecoder, wait_for_gpu
from tract_async.serving.kv_cache import build_cache
from tract_async.serving.model import cache_kwargs, greedy_continue
from tract_async.serving.streaming import (Abort, Aborted, GetLayer, check_generation,
                                           layer_reader)


class _Job:
    """One request's decode, shared by its coroutine (loop) and the compute thread."""

    def __init__(self, ids: list[int], past_len: int, max_new_tokens: int,
                 eos_token_id: int | None, fetch: Callable[[int], torch.Tensor] | None,
                 fetch_all: Callable[[], list[torch.Tensor]] | None,
                 emit: Callable[[int], None], ready: Callable[[], bool] | None,
                 on_start: Callable[[], None] | None, abort: Abort) -> None:
        self.ids = ids
        self.past_len = past_len
        self.max_new_tokens = max_new_tokens
        self.eos = eos_token_id
        self.fetch = fetch
        self.fetch_all = fetch_all
        self.emit = emit
        self.ready = ready
        self.on_start = on_start
        self.abort = abort
        self.tokens: list[int] = []
        self.result: concurrent.futures.Future[list[int]] = concurrent.futures.Future()

    @property
    def finished(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or (
            bool(self.tokens) and self.tokens[-1] == self.eos)

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self.emit(token)

    def succeed(self) -> None:
        if not self.result.done():
            self.result.set_result(list(self.tokens))

    def fail(self, exc: BaseException) -> None:
        if not self.result.done():
            self.result.set_exception(exc)


class DecodeBatcher:
    """``await batcher.generate(...)``: what ``streaming.generate_streaming`` returns, with the
    steps of concurrent requests batched. ``aclose()`` stops the thread (pending and running
    requests fail with ``asyncio.CancelledError``)."""

    def __init__(self, model: Any, *, max_batch: int, max_len: int,
                 graphs: bool | None = None) -> None:
        self.model = model
        self.decoder = BatchDecoder(model, max_batch=max_batch, max_len=max_len, graphs=graphs)
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._slots: list[_Job] = []          # slot s's job (the decoder's slot order)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.max_seen_batch = 0

    @property
    def max_batch(self) -> int:
        return self.decoder.max_batch

    async def generate(self, input_ids: Any, *, get_layer: GetLayer | None, past_len: int,
                       max_new_tokens: int, on_token: Callable[[int], object] | None = None,
                       eos_token_id: int | None = None, layer_timeout: float | None = None,
                       ready: Callable[[], bool] | None = None,
                       on_start: Callable[[], None] | None = None) -> list[int]:
        """Greedy tokens for a prompt whose first ``past_len`` tokens' KV arrive through
        ``get_layer`` (as ``generate_streaming``). ``ready()`` (thread-safe) says the KV is in
        hand, so the request may join a running batch; ``on_start()`` is called in the compute
        thread when its first pass begins.

        Raises:
            NothingToCompute, TokenIdError, ValueError, LayerWaitTimeout, KVShapeError, and
            whatever ``get_layer`` raises, as ``generate_streaming``.
        """
        ids = check_generation(self.model, input_ids, past_len, max_new_tokens)
        if max_new_tokens == 0:
            return []
        loop = asyncio.get_running_loop()
        abort = Abort()
        fetch: Callable[[int], torch.Tensor] | None = None
        fetch_all: Callable[[], list[torch.Tensor]] | None = None
        if past_len > 0:
            if get_layer is None:
                raise ValueError("past_len > 0 needs get_layer")
            read = layer_reader(self.model, get_layer, past_len, layer_timeout)
            num_layers = self.model.config.num_hidden_layers

            async def read_all() -> list[torch.Tensor]:
                return [await read(i) for i in range(num_layers)]

            def fetch_one(i: int) -> torch.Tensor:          # one layer, thread side
                return abort.submit(read(i), loop)

            def fetch_every() -> list[torch.Tensor]:        # every layer in one round trip
                return abort.submit(read_all(), loop)       # type: ignore[arg-type,return-value]

            fetch, fetch_all = fetch_one, fetch_every

        def emit(token: int) -> None:
            if on_token is not None:
                loop.call_soon_threadsafe(on_token, token)

        job = _Job(ids, past_len, max_new_tokens, eos_token_id, fetch, fetch_all, emit,
                   ready if past_len > 0 else None, on_start, abort)
        self._start()
        with self._cond:
            if self._stopping:
                raise asyncio.CancelledError()
            self._pending.append(job)
            self._cond.notify()
        try:
            return await asyncio.shield(asyncio.wrap_future(job.result))
        except asyncio.CancelledError:
            abort.set()                        # the thread drops the job at its next check
            with self._cond:
                if job in self._pending:       # never started: nothing to wait for
                    self._pending.remove(job)
                    job.fail(asyncio.CancelledError())
                self._cond.notify()
            await asyncio.wait({asyncio.wrap_future(job.result)})
            raise

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tract-decode-batch",
                                            daemon=True)
            self._thread.start()

    async def aclose(self) -> None:
        """Stop the compute thread (after the step it is in) and fail the requests it holds
        with ``asyncio.CancelledError``; idempotent."""
        with self._cond:
            self._stopping = True
            jobs = list(self._pending) + list(self._slots)
            self._cond.notify_all()
        for job in jobs:
            job.abort.set()                    # a first pass waiting for a layer unblocks
        t = self._thread
        if t is not None:
            await asyncio.to_thread(t.join)

    # --- the compute thread ----------------------------------------------------------------
    def _run(self) -> None:
        with torch.no_grad():
            while True:
                with self._cond:
                    while not self._stopping and not self._pending and not self._slots:
                        self._cond.wait()
                    if self._stopping:
                        break
                    pending = list(self._pending)
                self._admit(pending)
                if self._slots:
                    self._step()
        for job in self._pending + self._slots:
            job.fail(asyncio.CancelledError())
        self._pending.clear()
        self._slots.clear()

    def _take(self, job: _Job) -> None:
        with self._cond:
            self._pending.remove(job)

    def _admit(self, pending: list[_Job]) -> None:
        dec = self.decoder
        for job in pending:
            if job.abort.is_set():
                self._take(job)
                job.fail(asyncio.CancelledError())
                continue
            if dec.free_slots() == 0:
                return
            oversize = len(job.ids) + job.max_new_tokens > dec.max_len
            if self._slots and (oversize or (job.ready is not None and not job.ready())):
                continue                       # would stall the batch: later
            self._take(job)
            try:
                self._first_pass(job, alone=oversize)
            except Aborted:
                job.fail(asyncio.CancelledError())
            except BaseException as exc:       # noqa: BLE001 - the request's own error
                job.fail(exc)

    def _first_pass(self, job: _Job, *, alone: bool) -> None:
        """The prompt tokens after ``past_len``, the first token, then a slot; for ``alone``,
        the whole generation with transformers' step.

        Three forms. A tail of at most ``EXTEND_BUCKETS[-1]`` tokens after transferred KV runs
        on the decoder: with the KV in hand (``ready()``, or a source that has it all) as one
        extend; otherwise (only while no batch waits on this thread) layer by layer as the KV
        lands, overlapping a prefill still producing. Anything else (a whole prompt in
        recompute mode, a long tail, ``alone``) takes transformers' pass (SDPA on a GPU:
        compute-bound at those lengths), whose layer ``i`` also waits for layer ``i``'s KV.
        """
        model = self.model
        dec = self.decoder
        if job.on_start is not None:
            job.on_start()
        tail = job.ids[job.past_len:]
        if not alone and job.fetch is not None and len(tail) <= EXTEND_BUCKETS[-1]:
            if job.ready is None or job.ready():
                token = dec.admit_extend(job.fetch_all(), job.past_len, tail)  # type: ignore[misc]
            else:
                dec.stream_begin(job.past_len, tail)
                try:
                    for i in range(model.config.num_hidden_layers):
                        dec.stream_layer(i, job.fetch(i))
                    token = dec.stream_end()
                except BaseException:
                    dec.stream_abort()
                    raise
            job.add(token)
            self._slots.append(job)
            if job.finished:
                self._release(len(self._slots) - 1).succeed()
            return
        num_layers = model.config.num_hidden_layers
        if job.fetch is not None:
            cache = build_cache(num_layers, pending_past_len=job.past_len, fetch=job.fetch)
        else:
            cache = build_cache(num_layers)
        device = model.lm_head.weight.device
        tail = torch.tensor([job.ids[job.past_len:]], dtype=torch.long, device=device)
        out = model(input_ids=tail, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        first = torch.argmax(out.logits[0, -1])
        wait_for_gpu(device)               # a whole prompt's pass: without the GIL
        job.add(int(first))
        if job.finished:
            job.succeed()
            return
        if alone:
            greedy_continue(model, cache, job.tokens[-1],
                            max_new_tokens=job.max_new_tokens - len(job.tokens) + 1,
                            eos_token_id=job.eos, should_stop=job.abort.check, on_token=job.add)
            job.succeed()
            return
        self.decoder.admit([(layer.keys, layer.values) for layer in cache.layers])
        self._slots.append(job)

    def _step(self) -> None:
        dec = self.decoder
        for s in reversed(range(len(self._slots))):   # cancelled requests leave first
            if self._slots[s].abort.is_set():
                self._release(s).fail(asyncio.CancelledError())
        if not self._slots:
            return
        self.max_seen_batch = max(self.max_seen_batch, len(self._slots))
        try:
            nxt = dec.step([job.tokens[-1] for job in self._slots])
        except BaseException as exc:           # noqa: BLE001 - every request in the step fails
            while self._slots:
                self._release(len(self._slots) - 1).fail(exc)
            return
        self.steps += 1
        for job, token in zip(self._slots, nxt):
            job.add(token)
        for s in reversed(range(len(self._slots))):
            job = self._slots[s]
            if job.finished or dec.room(s) <= 0:
                self._release(s).succeed()

    def _release(self, s: int) -> _Job:
        job = self._slots[s]
        moved = self.decoder.release(s)
        if moved is not None:
            self._slots[s] = self._slots[moved]
            self._slots.pop(moved)
        else:
            self._slots.pop(s)
        return job
