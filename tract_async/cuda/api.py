"""The Engine's CUDA methods: ``CudaOps``, a part the Engine owns (composition), so that
``engine.py`` keeps one delegating line per public CUDA method and the CUDA path lives here.

    await eng.put_kv(keys, kv_cuda)                          # contiguous, like CPU tensors
    await eng.put_kv(keys, kv_layer_cuda, layer=i)           # layer streaming
    kv = await eng.get_kv(keys, device="cuda")               # or out=<cuda tensor>
    await eng.put_kv_paged(keys, pool, block_ids)            # vLLM pool(s) + one block id per key
    await eng.get_kv_paged(keys, pool, block_ids, layer=i)
    fut = await eng.start_put_kv(keys, kv, layer=i)          # StreamFuture: enqueued, not landed
    fut = await eng.start_get_kv(keys, layer=i, device="cuda")
    fut.wait_stream(torch.cuda.current_stream())             # order compute after the DMA
    out = await fut                                          # validated (or BlockEvicted)
    sampler = eng.start_telemetry(interval_s=0.05)           # pynvml time series

``ready`` (puts): the producer's CUDA event (or stream) the copy waits for; default: an event
recorded on the current stream at the call. ``after`` (gets into a caller's ``out``): the event
(or stream) the copy waits for before overwriting ``out``; default: the current stream when
``out`` is given, nothing when the engine allocates it. ``method``: ``dma``, ``dma2d``,
``zerocopy`` or ``auto`` (see ``cuda.copy``).

The region is registered with CUDA on the first CUDA call (or ``cuda_setup()``) and
unregistered when the engine closes. ``start_get_kv`` in transfer-only mode does not consume the
blocks it read (their deadline frees them); ``get_kv`` does.
"""
from __future__ import annotations

import asyncio
from typing import Any, Protocol, Sequence

from ..arrays import require_torch
from ..stores import plan as kvplan
from ..errors import TensorMismatch
from . import layerstream, store as cs

DRAIN_TIMEOUT_S = 30.0


class EngineParts(Protocol):
    """What the CUDA half uses of its engine: a typed view the Engine builds (``engine.py``,
    ``_Parts``), so that this module reads no private field of the Engine's. ``store`` is the
    region's store (None on an HTTP-only engine), ``xfer`` what put/get go through (the store,
    an HTTP store or a fallback), ``region`` the mapping (None without one); the three are None
    until the engine has started."""

    layout: Any
    store: Any
    xfer: Any
    region: Any

    def check_open(self) -> None: ...
    def lock_timeout(self, timeout: float | None) -> float: ...
    def spawn(self, coro: Any, name: str) -> "asyncio.Task[Any]": ...


class CudaOps:
    """CUDA entry points of one ``Engine``: owns its ``CudaPath`` (the region's CUDA
    registration, copiers, transfers in flight) and uses the engine through ``EngineParts``.
    The engine's public CUDA methods delegate here one to one (``engine.py``,
    ``_cuda_method``), with these signatures and docstrings."""

    def __init__(self, engine: EngineParts) -> None:
        self._eng = engine
        self._cuda: Any = None      # the CudaPath (or _TelemetryOnly), made on first use

    # -- setup --------------------------------------------------------------------------------
    def cuda_setup(self, *, method: str | None = None, piece_bytes: int = 32 << 20) -> Any:
        """Register the region with CUDA now (else on the first CUDA call); returns the CudaPath.
        ``method`` forces a copy method for every transfer (default auto)."""
        self._eng.check_open()
        if self._cuda is None:
            from .store import CudaPath
            store = self._eng.store
            self._cuda = CudaPath(self._eng.region, method=method,
                                  piece_bytes=piece_bytes,
                                  row_bytes=self._eng.layout.half_layer_bytes,
                                  blocks=getattr(store, "blocks", None))
        return self._cuda

    def path(self) -> Any:
        return self._cuda if self._cuda is not None else self.cuda_setup()

    def stats(self) -> dict[str, Any] | None:
        return None if self._cuda is None else self._cuda.describe()

    async def teardown(self) -> None:
        """Engine teardown hook: wait for transfers in flight, stop telemetry, unregister."""
        cp, errors = self._cuda, []
        if cp is None:
            return
        try:
            await cp.drain(DRAIN_TIMEOUT_S)
        except Exception as e:
            errors.append(e)
        t = cp.sampler_task
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
        try:
            cp.close()
        except Exception as e:
            errors.append(e)
        self._cuda = None
        if errors:
            raise errors[0]

    # -- contiguous ---------------------------------------------------------------------------
    async def start_put_kv(self, keys: Sequence[bytes], kv: Any, *, layer: int | None = None,
                           timeout: float | None = None, ready: Any = None,
                           method: str | None = None) -> Any:
        """Reserve and enqueue a put of a CUDA tensor; returns its StreamFuture (result: blocks
        written; the layer bits are published when its DMA has landed, awaited or not).
        Raises TensorMismatch, KeyMismatch, RegionFull, TransferTimeout, EngineClosed."""
        cp = self._cuda
        if layer is not None and method is None and cp is not None and cp.streams.puts:
            s = cp.streams.find_put(keys)       # a later layer (cuda/layerstream.py)
            if s is not None:
                self._eng.check_open()
                fut = await cs.put_layer(self._eng.store, cp, s, layer, kv, ready, timeout)
                if fut is not None:
                    return fut
        self._eng.check_open()
        ks = kvplan.check_keys(keys)
        kvplan.check_layer(layer, self._eng.layout)
        kvplan.check_tensor(kv, self._eng.layout, len(ks), layer, what="kv",
                            allow_cuda=True)
        if kv.device.type != "cuda":
            raise TensorMismatch("start_put_kv takes CUDA tensors; use put_kv for CPU tensors")
        kv = _contiguous(kv)
        return await cs.start_put(self._eng.store, self.path(), ks, [kv],
                                  cs.contiguous_plan_fn(self._eng.layout, len(ks), layer), layer,
                                  self.put_timeout(timeout), ready=ready, method=method)

    async def put_cuda(self, ks: list[bytes], kv: Any, layer: int | None,
                       timeout: float | None) -> int:
        """``put_kv`` with a CUDA tensor (hook target): through the engine's store dispatch like
        a CPU tensor (``stores/protocol.py``), so that a full region falls back to the network
        transport the same way (``FallbackStore``); the region store DMAs it."""
        kvplan.check_tensor(kv, self._eng.layout, len(ks), layer, what="kv",
                            allow_cuda=True)
        if not ks:
            return 0
        return await self._eng.xfer.put(ks, _contiguous(kv), layer, self.put_timeout(timeout))

    async def start_get_kv(self, keys: Sequence[bytes], *, out: Any = None,
                           layer: int | None = None, timeout: float | None = None,
                           device: Any = None, after: Any = None,
                           method: str | None = None) -> Any:
        """Wait for the blocks (``timeout``), enqueue the read into ``out`` (or a new tensor on
        ``device``); returns the StreamFuture (result: the tensor, validated).
        Raises BlockNotFound, LayerNotReady, TransferTimeout, BlockEvicted, TensorMismatch."""
        cp = self._cuda
        if (layer is not None and method is None and out is not None and device is None
                and cp is not None and cp.streams.gets):
            s = cp.streams.find_get(keys)       # a later layer (cuda/layerstream.py)
            if s is not None:
                self._eng.check_open()
                fut = await cs.get_layer(self._eng.store, cp, s, layer, out, _after(after),
                                          timeout, out)
                if fut is not None:
                    return fut
        torch = require_torch("a CUDA get (device='cuda')")

        self._eng.check_open()
        ks = kvplan.check_keys(keys)
        kvplan.check_layer(layer, self._eng.layout)
        cp = self.path()
        if out is None:
            dev = torch.device(device if device is not None else "cuda")
            if dev.type != "cuda":
                raise TensorMismatch(f"start_get_kv reads into CUDA tensors, got device={device}")
            copier = cp.copier(dev)
            # allocated on the DMA stream, which writes it first (the direct copies write it
            # there; the gather path's scatter stream waits for that stream before it writes):
            # no wait for the caller's queued work, and no write racing an earlier user of the
            # memory on another stream. Marked as used by the caller's stream so that freeing
            # it later is ordered after its use
            with torch.cuda.stream(copier.get_dma):
                out = torch.empty(self._eng.layout.kv_shape(len(ks), layer),
                                  dtype=self._eng.layout.dtype, device=copier.device)
            out.record_stream(torch.cuda.current_stream(copier.device))
            after = after if after is not None else False
        else:
            kvplan.check_tensor(out, self._eng.layout, len(ks), layer, what="out",
                                allow_cuda=True)
            if out.device.type != "cuda" or not out.is_contiguous():
                raise TensorMismatch("out must be a contiguous CUDA tensor")
        if not ks:
            return _done_future(cp, out)
        return await cs.start_get(self._eng.store, cp, ks, [out],
                                  cs.contiguous_plan_fn(self._eng.layout, len(ks), layer), layer,
                                  timeout, result=out, after=_after(after), method=method)

    async def get_cuda(self, ks: list[bytes], out: Any, layer: int | None,
                       timeout: float | None, device: Any) -> Any:
        """``get_kv`` into CUDA memory (hook target). On a region-only engine: the region's
        DMA, with the output allocated on the copy stream (``start_get_kv``). With a network
        transport: through the store dispatch, which reads each block from wherever it is."""
        if self._eng.region is not None and self._eng.xfer is self._eng.store:
            fut = await self.start_get_kv(ks, out=out, layer=layer, timeout=timeout,
                                          device=device)
            return await cs.finish_get(self._eng.store, self._cuda, ks, fut, layer)
        torch = require_torch("a CUDA get (device='cuda')")
        if out is None:
            out = torch.empty(self._eng.layout.kv_shape(len(ks), layer),
                              dtype=self._eng.layout.dtype,
                              device=torch.device(device if device is not None else "cuda"))
        else:
            kvplan.check_tensor(out, self._eng.layout, len(ks), layer, what="out",
                                allow_cuda=True)
        if not ks:
            return out
        return await self._eng.xfer.get(ks, out, layer, timeout)

    # -- paged --------------------------------------------------------------------------------
    async def start_put_kv_paged(self, keys: Sequence[bytes], pool: Any, block_ids: Any, *,
                                 layer: int | None = None, timeout: float | None = None,
                                 ready: Any = None, pool_layout: str = "2nb",
                                 method: str | None = None) -> Any:
        """Like ``start_put_kv`` from a paged pool (see ``cuda.paged`` for the forms):
        ``block_ids[i]`` is the pool block holding key ``i``."""
        from . import paged, tables
        self._eng.check_open()
        ks = kvplan.check_keys(keys)
        kvplan.check_layer(layer, self._eng.layout)
        p = paged.check_pool(pool, self._eng.layout, layer, pool_layout=pool_layout)
        ids = tables.check_block_ids(block_ids, len(ks), p.pool_blocks)
        cp = self.path()
        if not ks:
            return _done_future(cp, 0)
        return await cs.start_put(self._eng.store, cp, ks, list(p.tensors),
                                  cs.paged_plan_fn(self._eng.layout, p, ids, layer), layer,
                                  self.put_timeout(timeout), ready=ready, method=method)

    async def put_kv_paged(self, keys: Sequence[bytes], pool: Any, block_ids: Any, *,
                           layer: int | None = None, timeout: float | None = None,
                           ready: Any = None, pool_layout: str = "2nb",
                           method: str | None = None) -> int:
        """Store the KV of ``keys`` from pool blocks ``block_ids``; returns blocks written (after
        they are published). Raises as ``put_kv``."""
        ks = kvplan.check_keys(keys)
        fut = await self.start_put_kv_paged(ks, pool, block_ids, layer=layer, timeout=timeout,
                                            ready=ready, pool_layout=pool_layout, method=method)
        return await cs.finish_put(self._eng.store, self._cuda, ks, fut)

    async def start_get_kv_paged(self, keys: Sequence[bytes], pool: Any, block_ids: Any, *,
                                 layer: int | None = None, timeout: float | None = None,
                                 after: Any = None, pool_layout: str = "2nb",
                                 method: str | None = None) -> Any:
        """Enqueue reading ``keys`` into pool blocks ``block_ids``; the future's result is the
        pool. ``after`` defaults to the current stream (the pool is the caller's)."""
        from . import paged, tables
        self._eng.check_open()
        ks = kvplan.check_keys(keys)
        kvplan.check_layer(layer, self._eng.layout)
        p = paged.check_pool(pool, self._eng.layout, layer, pool_layout=pool_layout)
        ids = tables.check_block_ids(block_ids, len(ks), p.pool_blocks)
        cp = self.path()
        if not ks:
            return _done_future(cp, pool)
        return await cs.start_get(self._eng.store, cp, ks, list(p.tensors),
                                  cs.paged_plan_fn(self._eng.layout, p, ids, layer), layer, timeout,
                                  result=pool, after=_after(after), method=method)

    async def get_kv_paged(self, keys: Sequence[bytes], pool: Any, block_ids: Any, *,
                           layer: int | None = None, timeout: float | None = None,
                           after: Any = None, pool_layout: str = "2nb",
                           method: str | None = None) -> Any:
        """Read ``keys`` into pool blocks ``block_ids`` (every layer, or ``layer``); returns the
        pool once validated. Raises as ``get_kv``."""
        ks = kvplan.check_keys(keys)
        fut = await self.start_get_kv_paged(ks, pool, block_ids, layer=layer, timeout=timeout,
                                            after=after, pool_layout=pool_layout, method=method)
        return await cs.finish_get(self._eng.store, self._cuda, ks, fut, layer)

    # -- telemetry ----------------------------------------------------------------------------
    def start_telemetry(self, *, interval_s: float = 0.1, device_index: int = 0) -> Any:
        """Start (once) a pynvml sampler task owned by the engine; returns the NvmlSampler (a
        no-op where NVML is absent). It stops when the engine closes or ``stop_telemetry()``."""
        from .telemetry import NvmlSampler
        cp = self._cuda_path_for_telemetry()
        if cp.sampler is None:
            cp.sampler = NvmlSampler(device_index, interval_s=interval_s)
            cp.sampler_task = self._eng.spawn(cp.sampler.run(), "tract-nvml-sampler")
        return cp.sampler

    async def stop_telemetry(self) -> Any:
        """Stop the sampler; returns it (its series stay readable) or None."""
        cp = self._cuda
        if cp is None or cp.sampler_task is None:
            return None
        t, cp.sampler_task = cp.sampler_task, None
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        return cp.sampler

    def _cuda_path_for_telemetry(self) -> Any:
        import torch
        if self._cuda is None and not torch.cuda.is_available():
            # telemetry without CUDA: a holder that only carries the (no-op) sampler
            self._eng.check_open()
            self._cuda = _TelemetryOnly()
        return self.path()

    def put_timeout(self, timeout: float | None) -> float:
        return self._eng.lock_timeout(timeout)


class _TelemetryOnly:
    """Stands in for CudaPath on a machine without CUDA, so that telemetry still starts."""
    sampler: Any = None
    sampler_task: Any = None
    registered = False

    def __init__(self) -> None:
        self.streams = layerstream.Streams()    # always empty: no CUDA transfer runs here

    async def drain(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"registered": False, "fallback": None, "reason": "no CUDA"}
        if self.sampler is not None:
            out["telemetry"] = self.sampler.summary()
        return out


def _contiguous(t: Any) -> Any:
    return t if t.is_contiguous() else t.contiguous()


def _after(after: Any) -> Any:
    """``after=False``: no ordering (the engine allocated ``out``)."""
    if after is False:
        from .copy import NO_WAIT
        return NO_WAIT
    return after


def _done_future(cp: Any, value: Any) -> Any:
    from .futures import StreamFuture
    from .events import DONE
    return cp.track(StreamFuture(DONE, completion=lambda: value, label="empty"))


__all__ = ["CudaOps"]
