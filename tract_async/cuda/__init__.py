"""The CUDA path: stream-aware futures, region registration, gather/scatter, layer pipelining,
pynvml telemetry.

    futures   StreamFuture (awaitable CUDA event) and the process-wide poller thread
    hostreg   cudaHostRegister of the region mapping; ctypes libcudart for 2-D copies
    tables    row plans (pure numpy): kvplan / paged pools -> rows, runs, affine views
    copy      Copier: dma, dma2d and zerocopy (Triton) methods on per-device copy streams
    paged     checking vLLM-style paged pools
    store     the put / get protocol with device transfers (publish / validate after the DMA)
    api       the Engine's CUDA methods (put_kv_paged, start_get_kv, start_telemetry, ...)
    pipeline  LayerEvents (prefill) and LayerPrefetcher (decode)
    telemetry NvmlSampler

Importing this package (or any module but ``triton_copy``) makes no CUDA call and needs no GPU.
"""
from .futures import Poller, StreamFuture, poller
from .telemetry import NvmlSampler

__all__ = ["NvmlSampler", "Poller", "StreamFuture", "poller"]
