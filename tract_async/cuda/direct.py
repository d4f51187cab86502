"""Direct 2-D copies between a contiguous KV tensor and the registered region: no staging
buffer, no gather or scatter kernel, one ``cudaMemcpy2DAsync`` per K/V plane per run of evenly
spaced blocks.

Why. A contiguous layer tensor ``(2, n*T, H, D)`` holds the K rows of its ``n`` blocks back to
back (``half_layer_bytes`` each), then the V rows; the region holds block ``j``'s layer ``l`` at
``poff[j] + l*layer_bytes`` (K, then V). A request's blocks are reserved together, so their
payload offsets are usually one arithmetic sequence (stride: the slot size). Then the whole K
plane of a layer is one 2-D copy (source pitch ``half``, region pitch the stride, ``n`` rows of
``half`` bytes) and the V plane another: two calls into the driver for any ``n``, moved by the
copy engine at the link's speed (64 KiB rows every 2 MiB were measured at the pinned ceiling on
the H200, ``copy.py``'s ``dma2d``). The copy path this replaces for these tensors (``copy.Copier``
``put``/``get``) first gathered the rows into a staging tensor in region order with a strided copy
kernel, built the plan, its runs and its affine description with numpy, then moved the staging
buffer: four to six numpy passes, a kernel and a second pass over the bytes per layer (measured on
the H100 host at main 06f8c2a: a 213-block layer put 0.81 ms host and device against 0.26 ms
raw; 315 µs for one block).

A whole-block tensor ``(L, 2, n*T, H, D)`` is ``2L`` such planes: ``2L`` copies per run.

Runs (``segments``): maximal ranges of consecutive blocks (tensor order) whose payload offsets
step by one constant stride of at least the bytes each block's copy covers (a 2-D copy's pitch
must be at least its width, and rows must not overlap). A transfer whose blocks split into more
than ``MAX_CALLS`` copies (scattered offsets: a prefix cache's blocks, freed and reused) keeps the
gather path, which moves any plan in a few DMAs.

Pure arithmetic on int64 arrays plus the driver calls; the CPU-side functions (``segments``,
``copies``) are tested without CUDA.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from .hostreg import CUDA_MEMCPY_DEFAULT, cudart_lib

MAX_PITCH = 1 << 30
"""The widest stride a run's 2-D copy takes (the driver refuses pitches past ~2 GiB)."""

MAX_CALLS = 256
"""Most 2-D copies one transfer may take on this path (~1.5-2 µs of host time each through
ctypes); beyond it, the gather path's few large DMAs cost less host time."""


@njit(cache=True)             # µs-scale: holds the GIL (stores/fused.py, "Holding the GIL")
def segments(poffs, span, max_pitch=MAX_PITCH):
    """Runs of blocks with evenly spaced payload offsets: rows ``(first, count, stride)``.

    ``span``: the bytes of each block one copy row covers (a 2-D copy needs ``span <= stride
    <= max_pitch``; a single block's run has stride 0). Blocks are taken in the order given
    (tensor order)."""
    n = poffs.shape[0]
    out = np.empty((max(n, 1), 3), dtype=np.int64)
    k = 0
    i = 0
    while i < n:
        cnt = 1
        stride = np.int64(0)
        if i + 1 < n:
            s = poffs[i + 1] - poffs[i]
            if s >= span and s <= max_pitch:
                stride = s
                cnt = 2
                while i + cnt < n and poffs[i + cnt] - poffs[i + cnt - 1] == stride:
                    cnt += 1
        out[k, 0] = i
        out[k, 1] = cnt
        out[k, 2] = stride
        k += 1
        i += cnt
    return out[:k]


@njit(cache=True)             # µs-scale: holds the GIL (stores/fused.py, "Holding the GIL")
def copies(segs, poffs, n, planes, half, region_rel, tensor_base, region_base):
    """The 2-D copies of a transfer, one row per copy: ``(region address, region pitch, tensor
    address, tensor pitch, height)``; every row is ``half`` bytes wide.

    ``planes``: the (layer, K/V) planes of the tensor (2 for one layer, ``2L`` for all);
    ``region_rel``: the first plane's offset inside a block's payload (``layer*layer_bytes``,
    or 0 for all layers). Plane ``p`` of block ``j`` is tensor row ``p*n + j`` and region bytes
    ``poffs[j] + region_rel + p*half``."""
    s = segs.shape[0]
    out = np.empty((s * planes, 5), dtype=np.int64)
    k = 0
    for q in range(s):
        first = segs[q, 0]
        cnt = segs[q, 1]
        stride = segs[q, 2]
        pitch = stride if cnt > 1 else half
        for p in range(planes):
            out[k, 0] = region_base + poffs[first] + region_rel + p * half
            out[k, 1] = pitch
            out[k, 2] = tensor_base + (p * n + first) * half
            out[k, 3] = half
            out[k, 4] = cnt
            k += 1
    return out


class DirectCopy:
    """What one transfer of a contiguous tensor needs on this path, planned on the host:
    ``calls`` holds one ``(region address, region pitch, tensor address, tensor pitch, width,
    height)`` per 2-D copy; ``half`` is the K or V half of a block's layer (the width of every
    copy but a single block's, whose planes are contiguous on both sides: one copy)."""

    __slots__ = ("calls", "half", "nbytes")

    def __init__(self, calls: list[tuple[int, int, int, int, int, int]], half: int,
                 nbytes: int) -> None:
        self.calls = calls
        self.half = half
        self.nbytes = nbytes

    @property
    def rows(self) -> np.ndarray:
        """``calls`` as an int64 array (one row per copy)."""
        return np.array(self.calls, dtype=np.int64).reshape(-1, 6)

    def __len__(self) -> int:
        return len(self.calls)


class Template:
    """The copies of a transfer with the layer and the tensor's address left open.

    Why. Every layer of a layer-streamed put or get moves the same blocks: the same payload
    offsets, so the same runs and the same copies, shifted by ``layer * layer_bytes`` in the
    region and by the layer tensor's address. Planning them (``segments`` + ``copies``: two
    Numba dispatches and the array work, ~6 µs on the 2-core VM and 2-3x that on the GPU hosts)
    once per request leaves two additions per copy for each later layer (``at``)."""

    __slots__ = ("calls", "half", "nbytes", "layer_bytes", "poffs", "whole")

    def __init__(self, calls: list[tuple[int, int, int, int, int, int]], half: int, nbytes: int,
                 layer_bytes: int, poffs: np.ndarray, whole: bool) -> None:
        self.calls = calls
        self.half = half
        self.nbytes = nbytes
        self.layer_bytes = layer_bytes
        self.poffs = poffs
        self.whole = whole

    def at(self, layer: int | None, tensor_ptr: int) -> DirectCopy:
        """The copies for ``layer`` (None: a whole-block tensor) from / to ``tensor_ptr``."""
        d = 0 if layer is None else layer * self.layer_bytes
        return DirectCopy([(r + d, rp, tensor_ptr + t, tp, w, h)
                           for r, rp, t, tp, w, h in self.calls], self.half, self.nbytes)


def template(layout: Any, poffs: np.ndarray, whole: bool, region_ptr: int) -> Template | None:
    """The copies of blocks ``poffs`` (tensor order) at layer 0 and tensor address 0: one
    layer's two planes, or (``whole``) every layer's. None when they would take more than
    ``MAX_CALLS`` copies (use the gather path)."""
    n = int(poffs.shape[0])
    half = layout.half_layer_bytes
    if whole:
        planes, span = 2 * layout.num_layers, layout.block_bytes
    else:
        planes, span = 2, layout.layer_bytes
    nbytes = n * planes * half
    if n == 1:
        # one block: its planes follow each other in the tensor and in the region (a layer's K
        # then V; every layer's): one copy instead of ``planes`` (a driver call is ~3.8 µs of
        # host time on the H100 host, a one-block layer's whole transfer ~10 µs)
        calls = [(region_ptr + int(poffs[0]), nbytes, 0, nbytes, nbytes, 1)]
        return Template(calls, half, nbytes, layout.layer_bytes, poffs, whole)
    segs = segments(poffs, span)
    if segs.shape[0] * planes > MAX_CALLS:
        return None
    rows = copies(segs, poffs, n, planes, half, 0, 0, region_ptr)
    calls = [(r, rp, t, tp, half, h) for r, rp, t, tp, h in rows.tolist()]
    return Template(calls, half, nbytes, layout.layer_bytes, poffs, whole)


def plan(layout: Any, poffs: np.ndarray, layer: int | None, tensor_ptr: int,
         region_ptr: int) -> DirectCopy | None:
    """The copies moving blocks ``poffs`` (tensor order) of a contiguous tensor at
    ``tensor_ptr``: one layer's planes or all of them. None when they would take more than
    ``MAX_CALLS`` copies (use the gather path)."""
    t = template(layout, poffs, layer is None, region_ptr)
    return None if t is None else t.at(layer, tensor_ptr)


_NONE = object()


class TemplateCache:
    """The templates of the last few transfers' payload offsets, for one layout and region.

    A put's later layers pass the very array of its batch (``FillBatch.offsets``: found by
    identity); a get's pass a fresh snapshot of the same offsets (found by length, first
    element and one array comparison). Offsets that need the gather path are remembered too
    (as None). ``size`` entries: a few requests streaming at once."""

    def __init__(self, layout: Any, region_ptr: int, size: int = 8) -> None:
        self.layout = layout
        self.region_ptr = region_ptr
        self.size = size
        self._entries: list[tuple[np.ndarray, bool, Template | None]] = []
        self.hits = 0
        self.misses = 0

    def get(self, poffs: np.ndarray, whole: bool) -> Template | None:
        ents = self._entries
        for e in ents:
            if e[0] is poffs and e[1] is whole:
                self.hits += 1
                return e[2]
        n = poffs.shape[0]
        first = poffs[0] if n else None
        for k, e in enumerate(ents):
            p = e[0]
            if (e[1] is whole and p.shape[0] == n and n and p[0] == first
                    and np.array_equal(p, poffs)):
                self.hits += 1
                if k:
                    ents.insert(0, ents.pop(k))
                return e[2]
        self.misses += 1
        t = template(self.layout, poffs, whole, self.region_ptr)
        ents.insert(0, (poffs, whole, t))
        del ents[self.size:]
        return t

    def plan(self, poffs: np.ndarray, layer: int | None, tensor_ptr: int) -> DirectCopy | None:
        """``plan`` through the cache."""
        t = self.get(poffs, layer is None)
        return None if t is None else t.at(layer, tensor_ptr)


def issue(dc: DirectCopy, stream_handle: int, *, to_region: bool, fc: Any = None) -> int:
    """Enqueue the copies on the stream (the caller orders the stream first). Returns how many
    driver calls were made. ``fc``: ``events.FastCalls`` (the GIL stays held), else through the
    ``CDLL`` handle. Raises RuntimeError if one fails (nothing after it is enqueued)."""
    if fc is not None:
        f = fc.memcpy2d
    else:
        lib = cudart_lib()
        if lib is None:
            raise RuntimeError("libcudart not found through ctypes: no 2-D copies")
        f = lib.cudaMemcpy2DAsync     # argtypes set by cudart_lib: plain ints go straight in
    for reg, rpitch, ten, tpitch, width, height in dc.calls:
        if to_region:
            err = f(reg, rpitch, ten, tpitch, width, height, CUDA_MEMCPY_DEFAULT, stream_handle)
        else:
            err = f(ten, tpitch, reg, rpitch, width, height, CUDA_MEMCPY_DEFAULT, stream_handle)
        if err:
            src, dst = ((ten, tpitch), (reg, rpitch)) if to_region else ((reg, rpitch),
                                                                         (ten, tpitch))
            raise RuntimeError(f"cudaMemcpy2DAsync failed with cudaError {err} (dst="
                               f"{dst[0]:#x} dpitch={dst[1]} src={src[0]:#x} spitch={src[1]} "
                               f"width={width} height={height})")
    return len(dc)
