"""Layer reads ahead of the decode step that needs them.

The decode worker's first step walks the layers in order, and each layer's KV arrives as the
prefill publishes it. Awaiting layer l's read only when step l starts leaves the copy engine idle
while layer l-1 computes; reading ``depth`` layers ahead overlaps the read of l+1 (often already
published) with the compute of l. The reads are the worker's own (``DecodeWorker._get_layer_kv``),
so the CPU and CUDA paths, and their fallbacks, are the same as without prefetching.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable


class LayerReads:
    """``await reads(l)``: layer ``l``'s KV, with layers ``l+1 .. l+depth`` already being read.

    ``read(l)`` performs one layer's read. ``aclose()`` cancels the reads nobody asked for and
    waits for them, so nothing still writes into a buffer after the request ends; an error of
    such a read is dropped (its layer was never used), an error of an awaited one is raised.
    """

    def __init__(self, read: Callable[[int], Awaitable[Any]], num_layers: int, *,
                 depth: int = 2) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._read = read
        self.num_layers = num_layers
        self.depth = depth
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        self.started: list[int] = []          # layers in the order their reads began

    def _ensure(self, layer: int) -> None:
        loop = asyncio.get_running_loop()
        for j in range(layer, min(self.num_layers, layer + self.depth + 1)):
            if j not in self._tasks and j not in self.started:
                self.started.append(j)
                self._tasks[j] = loop.create_task(self._read(j))

    async def __call__(self, layer: int) -> Any:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} of {self.num_layers}")
        if layer in self.started and layer not in self._tasks:
            raise RuntimeError(f"layer {layer} was already read")
        self._ensure(layer)
        task = self._tasks.pop(layer)
        return await task

    async def aclose(self) -> None:
        pending = list(self._tasks.values())
        self._tasks.clear()
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
