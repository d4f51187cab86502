"""Raw CUDA events and the enqueue-only cudart calls of the hot path, holding the GIL.

Why not ``torch.cuda.Event`` and ``torch.cuda.current_stream()`` on the direct path. A layer of a
layer-streamed transfer costs a handful of driver calls (two 2-D copies, an event to order the
copy stream after the producer, an event to learn that the copy landed). Measured on the GPU
hosts (``bench/results/gpu-20261206-s36/``, the probe): ``torch.cuda.current_stream()`` ~4 µs,
``torch.cuda.Event()`` + ``record`` ~2.2 µs, a ``cudaMemcpy2DAsync`` through ``ctypes.CDLL`` ~3 µs;
a one-block layer put cost ~79 µs of host time against a target of 30. Two things here:

* ``ctypes.PyDLL`` calls keep the GIL. A ``CDLL`` call releases and re-takes it around every
  foreign call, and with the CUDA poller thread waiting for the GIL each release hands it over:
  the loop thread then waits out the poller's round in the middle of enqueueing a layer. These
  calls only enqueue (a few hundred nanoseconds in the driver), so holding the GIL costs nobody
  anything. Blocking calls (``cudaEventSynchronize``) keep releasing it.
* One raw event per copy stream orders it after the caller's current stream
  (``torch._C._cuda_getCurrentRawStream``: the handle, without building a Stream object), and a
  pool of raw events (``EventPool``) marks the ends of transfers: recorded, queried by the poller
  or the awaiting spinner, and given back to the pool once the transfer has landed.

An event handed back may be recorded again for a later transfer: whoever still holds a landed
future's ``event`` may wait for that later work (never for less); the future itself replaces its
event with ``DONE`` when it lands.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
EVENT_DISABLE_TIMING = 2


class _Done:
    """An event that has completed (a landed transfer's, or one finished on the host)."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_on(self, stream_handle: int) -> None:
        return None


DONE = _Done()


class FastCalls:
    """cudart's enqueue calls through ``ctypes.PyDLL`` (GIL held), plus the blocking ones
    through the ``CDLL`` handle (GIL released). Built by ``fast_calls()``."""

    def __init__(self, name: str, slow: Any) -> None:
        lib = ctypes.PyDLL(name)
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self.memcpy2d = lib.cudaMemcpy2DAsync
        self.memcpy2d.restype = i
        self.memcpy2d.argtypes = [vp, sz, vp, sz, sz, sz, i, vp]
        self.event_record = lib.cudaEventRecord
        self.event_record.restype = i
        self.event_record.argtypes = [vp, vp]
        self.event_query = lib.cudaEventQuery
        self.event_query.restype = i
        self.event_query.argtypes = [vp]
        self.stream_wait_event = lib.cudaStreamWaitEvent
        self.stream_wait_event.restype = i
        self.stream_wait_event.argtypes = [vp, vp, ctypes.c_uint]
        self.event_synchronize = slow.cudaEventSynchronize      # blocks: releases the GIL
        self.event_synchronize.restype = i
        self.event_synchronize.argtypes = [vp]
        self.event_create = slow.cudaEventCreateWithFlags
        self.event_create.restype = i
        self.event_create.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.event_destroy = slow.cudaEventDestroy
        self.event_destroy.restype = i
        self.event_destroy.argtypes = [vp]
        self.memcpy_batch = _bind_memcpy_batch(lib, slow)
        import torch
        self.current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_FAST: FastCalls | None = None
_FAST_TRIED = False


BATCH_MIN_RUNTIME = 13000
"""``cudaMemcpyBatchAsync`` is bound only from CUDA 13.0's runtime on: 12.8 and 12.9 export the
same name with one more parameter (``failIdx``), so the 13.0 signature would be a wrong call
there."""


def _bind_memcpy_batch(lib: Any, slow: Any) -> Any:
    """``cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)``
    through ``lib`` (GIL held: it only enqueues), or None where the runtime predates 13.0 or
    lacks it. Whether the driver runs it is checked once per copier (``direct.batch_probe``)."""
    try:
        ver = ctypes.c_int(0)
        getv = slow.cudaRuntimeGetVersion
        getv.restype = ctypes.c_int
        getv.argtypes = [ctypes.POINTER(ctypes.c_int)]
        if getv(ctypes.byref(ver)) != CUDA_SUCCESS or ver.value < BATCH_MIN_RUNTIME:
            return None
        f = lib.cudaMemcpyBatchAsync
    except AttributeError:
        return None
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    f.restype = ctypes.c_int
    f.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp]
    return f


def fast_calls() -> FastCalls | None:
    """The hot path's cudart calls, or None where libcudart or torch's raw stream getter is not
    reachable (the torch Event / Stream path is used then)."""
    global _FAST, _FAST_TRIED
    if _FAST_TRIED:
        return _FAST
    _FAST_TRIED = True
    from .hostreg import cudart_lib
    slow = cudart_lib()
    if slow is None:
        return None
    try:
        fc = FastCalls(slow._name, slow)
    except (OSError, AttributeError):
        return None
    if fc.current_raw_stream is None:
        return None
    _FAST = fc
    return fc


def check(err: int, what: str) -> None:
    if err != CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed with cudaError {err}")


class RawEvent:
    """One cudaEvent_t (timing disabled) of an ``EventPool``: what a StreamFuture needs of an
    event (``query``, ``synchronize``) and what its ``wait_stream`` uses (``wait_on``)."""

    __slots__ = ("handle", "pool")

    def __init__(self, handle: int, pool: "EventPool") -> None:
        self.handle = handle
        self.pool = pool

    def record(self, stream_handle: int) -> "RawEvent":
        check(self.pool.fc.event_record(self.handle, stream_handle), "cudaEventRecord")
        return self

    def query(self) -> bool:
        err = self.pool.fc.event_query(self.handle)
        if err == CUDA_SUCCESS:
            return True
        if err == CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cudaEventQuery failed with cudaError {err}")

    def synchronize(self) -> None:
        check(self.pool.fc.event_synchronize(self.handle), "cudaEventSynchronize")

    def wait_on(self, stream_handle: int) -> None:
        """Make the stream wait for this event's recorded work (no host synchronization)."""
        check(self.pool.fc.stream_wait_event(stream_handle, self.handle, 0),
              "cudaStreamWaitEvent")

    def release(self) -> None:
        """Back to the pool (its transfer has landed)."""
        self.pool.free.append(self)


class EventPool:
    """Raw events of one device, reused: creating one costs a driver call, recording a reused
    one does not. ``take`` and ``release`` are single list operations (atomic under the GIL)."""

    def __init__(self, fc: FastCalls, device: Any) -> None:
        self.fc = fc
        self.device = device
        self.free: list[RawEvent] = []
        self.created = 0
        self._lock = threading.Lock()

    def take(self) -> RawEvent:
        try:
            return self.free.pop()
        except IndexError:
            return self._create()

    def _create(self) -> RawEvent:
        import torch
        h = ctypes.c_void_p()
        with self._lock, torch.cuda.device(self.device):
            check(self.fc.event_create(ctypes.byref(h), EVENT_DISABLE_TIMING),
                  "cudaEventCreateWithFlags")
            self.created += 1
        return RawEvent(int(h.value or 0), self)


class StreamOrder:
    """Orders one copy stream after the caller's current stream with one raw event: record it
    on the current stream, make the copy stream wait for it. The event may be recorded again
    at once (a wait captures the work recorded when it is issued), so one serves every
    transfer; the lock keeps a record and its wait together if two threads enqueue."""

    def __init__(self, pool: EventPool, device_index: int) -> None:
        self.fc = pool.fc
        self.ev = pool.take()
        self.index = device_index
        self._lock = threading.Lock()

    def after_current(self, stream_handle: int) -> None:
        fc = self.fc
        cur = fc.current_raw_stream(self.index)
        if cur == stream_handle:
            return
        with self._lock:
            check(fc.event_record(self.ev.handle, cur), "cudaEventRecord")
            check(fc.stream_wait_event(stream_handle, self.ev.handle, 0), "cudaStreamWaitEvent")
