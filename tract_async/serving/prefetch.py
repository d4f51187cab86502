"""Layer reads ahead of the decode step that needs them.

The decode worker's first step walks the layers in order, and each layer's KV arrives as the
prefill publishes it. Awaiting layer l's read only when step l starts leaves the copy engine idle
while layer l-1 computes; one reader that reads every layer as soon as it is published overlaps
the reads with the compute (and with the wait for a batch slot). The reads are the worker's own
(``DecodeWorker._get_layer_kv``), so the CPU and CUDA paths, and their fallbacks, are the same as
without prefetching.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable


class LayerStream:
    """``await stream(l)``: layer ``l``'s KV, read by one task that walks the layers in order as
    far ahead as ``ahead`` layers past the one last asked for (None: every layer).

    Why one reader walking ahead, not reads started a fixed depth ahead of the compute (the former
    ``LayerReads``). A decode worker's first step computes layer ``l`` only after the
    prefill published it, and computing shares the GPU with the prefills of other requests: with
    reads started only two layers ahead of the compute, the last layers' reads began when the
    compute reached them -- tens of milliseconds after their publication (the H100 serving run of
    2026-12-06: the last layer of an 8K-token prompt arrived 18-86 ms after the prefill published
    it, kv_load 34 ms mean). Reading every layer the moment it is published takes the transfer
    off that path: the reads cost the same memory (every layer's KV ends in the cache anyway),
    and one task waits at a time, so no more pollers run than with one read ahead.

    ``aclose()`` cancels the reader and waits for it (nothing writes a buffer after the request
    ends); an error of a layer nobody asked for is dropped, an awaited layer's is raised.
    """

    def __init__(self, read: Callable[[int], Awaitable[Any]], num_layers: int, *,
                 ahead: int | None = None,
                 on_ask: Callable[[int], object] | None = None) -> None:
        if ahead is not None and ahead < 0:
            raise ValueError(f"ahead must be >= 0 or None, got {ahead}")
        self._read = read
        self._on_ask = on_ask
        self.num_layers = num_layers
        self.ahead = ahead
        self._results: list[asyncio.Future[Any] | None] = [None] * num_layers
        self._asked = -1                 # the highest layer asked for so far
        self._given: set[int] = set()
        self._move = asyncio.Event()     # the consumer asked for a later layer
        self._task: asyncio.Task[None] | None = None
        self.started: list[int] = []     # layers in the order their reads began

    def _future(self, layer: int) -> "asyncio.Future[Any]":
        f = self._results[layer]
        if f is None:
            f = self._results[layer] = asyncio.get_running_loop().create_future()
        return f

    @property
    def settled(self) -> bool:
        """Every layer's read has ended (a value or an error): a consumer asking for any layer
        now does not wait. Safe to read from another thread (it only reads futures' states), so
        the decode batcher's compute thread asks it before admitting a request."""
        return all(f is not None and f.done() for f in self._results)

    async def all_read(self) -> None:
        """Wait until :attr:`settled` (starting the reader if needed); never raises a layer's
        error (whoever asks for that layer gets it)."""
        self.start()
        await asyncio.wait([self._future(j) for j in range(self.num_layers)])

    def start(self) -> None:
        """Begin reading now, before any layer is asked for (the decode worker calls it when a
        request arrives, so its reads overlap its wait for the compute slot). With ``ahead``
        set, it reads layers ``0 .. ahead-1`` until asked for more. Idempotent; on the loop
        only."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._walk())

    async def _walk(self) -> None:
        for j in range(self.num_layers):
            while self.ahead is not None and j > self._asked + self.ahead:
                self._move.clear()
                await self._move.wait()
            f = self._future(j)
            self.started.append(j)
            try:
                value = await self._read(j)
            except asyncio.CancelledError:
                if not f.done():
                    f.cancel()
                raise
            except BaseException as e:       # noqa: BLE001 - handed to whoever asks for layer j
                self._fail(j, e)
                return                       # the layers after it are not read
            if not f.done():
                f.set_result(value)

    def _fail(self, j: int, error: BaseException) -> None:
        """Layer ``j``'s read raised ``error``: it is layer ``j``'s result, and every later
        layer's is a RuntimeError saying why it was not read (nobody waits forever)."""
        for k in range(j, self.num_layers):
            f = self._future(k)
            if f.done():
                continue
            if k == j:
                f.set_exception(error)
            else:
                e = RuntimeError(f"layer {k} was not read: layer {j}'s read failed")
                e.__cause__ = error
                f.set_exception(e)
            f.exception()                    # not "never retrieved" if nobody asks

    async def __call__(self, layer: int) -> Any:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} of {self.num_layers}")
        if layer in self._given:
            raise RuntimeError(f"layer {layer} was already read")
        self._given.add(layer)
        if self._on_ask is not None:
            self._on_ask(layer)
        if layer > self._asked:
            self._asked = layer
            self._move.set()
        self.start()
        return await asyncio.shield(self._future(layer))

    async def aclose(self) -> None:
        t, self._task = self._task, None
        if t is not None and not t.done():
            t.cancel()
        if t is not None:
            await asyncio.gather(t, return_exceptions=True)
        for f in self._results:
            if f is not None and not f.done():
                f.cancel()
