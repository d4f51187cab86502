"""Layer pipelining helpers for a transformers Llama on the GPU.

Prefill: ``prefill_streaming`` hands layer ``i``'s KV to the loop as soon as it is produced, but
the loop's ``put_kv`` only runs later, by when the computing thread has queued more layers on
the stream; an event recorded *then* would make the DMA wait for those too. :class:`LayerEvents`
records an event in the computing thread right after layer ``i``'s attention (a forward hook),
and ``put_layer`` passes it as ``ready=``: the DMA of layer ``i`` starts while layer ``i + 1``
computes.

Decode: :class:`LayerPrefetcher` is a ``get_layer`` for ``decode_streaming`` that, when layer
``i`` is asked for, has already started the reads of layers ``i + 1 .. i + depth``, so a layer's
DMA overlaps the attention over the previous one (and each read waits, in the engine, for its
layer to be published by the producer).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence


class LayerEvents:
    """Per-layer CUDA events recorded in the computing thread after each attention block.

    Only forward passes over at least ``min_tokens`` tokens record (a prefill, not the decode
    steps that may share the model). Call ``reset()`` before each prefill, ``close()`` at the end.
    """

    def __init__(self, model: Any, *, min_tokens: int = 2) -> None:
        self._loop = asyncio.get_running_loop()
        self._futs: dict[int, asyncio.Future] = {}
        self.min_tokens = min_tokens
        self.recorded_at: dict[int, float] = {}
        self._handles = [layer.self_attn.register_forward_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(model.model.layers)]

    def _hook(self, index: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            import torch
            hs = kwargs.get("hidden_states", args[0] if args else None)
            if hs is None or hs.shape[-2] < self.min_tokens:
                return
            ev = torch.cuda.Event()
            ev.record()                          # the computing thread's current stream
            self.recorded_at[index] = time.perf_counter()
            self._loop.call_soon_threadsafe(self._set, index, ev)
        return hook

    def _fut(self, index: int) -> asyncio.Future:
        f = self._futs.get(index)
        if f is None:
            f = self._futs[index] = self._loop.create_future()
        return f

    def _set(self, index: int, ev: Any) -> None:
        f = self._fut(index)
        if not f.done():
            f.set_result(ev)

    async def event(self, index: int, timeout: float = 60.0) -> Any:
        """The event of layer ``index`` of the current prefill (waits until it is recorded)."""
        async with asyncio.timeout(timeout):
            return await asyncio.shield(self._fut(index))

    def reset(self) -> None:
        self._futs.clear()
        self.recorded_at.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class LayerPrefetcher:
    """``get_layer(i)`` for ``decode_streaming`` with reads ``depth`` layers ahead.

    Use as ``async with LayerPrefetcher(eng, keys, num_layers) as get_layer:``; leaving cancels
    reads not yet started and waits for those in flight. ``timeline`` holds, per layer, when its
    read was asked for, started (enqueued) and validated (perf_counter seconds).
    """

    def __init__(self, engine: Any, keys: Sequence[bytes], num_layers: int, *, depth: int = 2,
                 timeout: float = 30.0) -> None:
        self.engine = engine
        self.keys = list(keys)
        self.num_layers = num_layers
        self.depth = depth
        self.timeout = timeout
        self._tasks: dict[int, asyncio.Task] = {}
        self.timeline: dict[int, dict[str, float]] = {}

    async def __aenter__(self) -> "LayerPrefetcher":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _ensure(self, index: int) -> None:
        for j in range(index, min(self.num_layers, index + self.depth + 1)):
            if j not in self._tasks:
                self.timeline.setdefault(j, {})["asked"] = time.perf_counter()
                self._tasks[j] = asyncio.get_running_loop().create_task(self._read(j))

    async def _read(self, index: int) -> Any:
        fut = await self.engine.start_get_kv(self.keys, layer=index, device="cuda",
                                             timeout=self.timeout)
        self.timeline[index]["enqueued"] = time.perf_counter()
        try:
            out = await fut
        except asyncio.CancelledError:
            fut.cancel()
            await asyncio.shield(fut.wait_landed())
            raise
        self.timeline[index]["validated"] = time.perf_counter()
        return out

    async def __call__(self, index: int) -> Any:
        self._ensure(index)
        return await self._tasks[index]

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            if not t.done():
                t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
