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

A whole-block tensor ``(L, 2, n*T, H, D)`` is ``2L`` such planes: ``2L`` copies per run. Or,
with ``TRACT_CUDA_WHOLE=blocks`` (not the default), one copy per block: its ``2L`` rows strided
by ``n*half`` in the tensor and contiguous in the region (2 MiB of a Llama-3-8B block written in
order), ``n`` calls for any placement of the blocks. Why a second form: the planes pattern ran
at 0.96x of a contiguous copy of the same bytes on the H100 host (``bench/dma_memory.py``,
``bench/results/gpu-20261207-s50``), and a whole prompt's put needs 0.9x with its host work
included; ``bench/dma_memory.py``'s ``*_blocks`` rows say whether the block pattern moves
faster, and an A/B of this switch whether it pays for its ~3x more driver calls (written
without a GPU: off until measured).

Runs (``segments``): maximal ranges of consecutive blocks (tensor order) whose payload offsets
step by one constant stride of at least the bytes each block's copy covers (a 2-D copy's pitch
must be at least its width, and rows must not overlap). A transfer whose blocks split into more
than ``max_calls`` copies (scattered offsets: a prefix cache's blocks, freed and reused) takes
the gather path instead (``copy.Copier.put``/``get``): where Triton is there, that is the
zero-copy row kernel, one launch for any plan (``ZEROCOPY_MAX_CALLS``); else staging and a few
large DMAs (``MAX_CALLS``).

Batches. Blocks that do not sit evenly spaced (a prefix cache's blocks, freed and reused out of
order) split into many runs, and each run is ``planes`` driver calls of ~2 µs host time: a
213-block layer in ~125 runs took 500 µs of host time in ``issue`` on the H100 host, twice its
DMA (``bench/results/gpu-20261207-s45``). Where the runtime has ``cudaMemcpyBatchAsync`` (CUDA
13.0 on) and the driver runs it (``batch_probe``), a plan of more than ``BATCH_MIN_CALLS`` 2-D
copies goes instead as one batch of 1-D copies, one per block and plane (``Template.batch``):
one driver call for any number of runs, up to ``BATCH_MAX_COPIES`` copies. ``TRACT_CUDA_BATCH``
(``auto``, ``off``, ``all``: every multi-block plan batched) picks the policy, for A/B runs.

Measured on an H100 host (``bench/copy_batch.py``, ``bench/results/gpu-20261207-s48``), a
batch is the slowest way at every size: the driver spends ~0.8 µs of host time per copy in the
call (313-364 µs for a 213-block layer's 426 copies, 1.5-1.7 ms for 1024 blocks) and the device
moves 32 KiB copies at 0.40-0.48x the raw rate (a 213-block layer 582-655 µs where two 2-D
copies of evenly spaced blocks take 264-266 and the zero-copy kernel 321-336 for scattered
ones); only against 56 2-D copies of 32 scattered blocks (260 µs of calls) does it win, and
the zero-copy kernel wins there too (97-100 µs against 109-111). So ``off`` is the default and
scattered plans go to the zero-copy kernel; ``auto`` and ``all`` stay for measuring.

Pure arithmetic on int64 arrays plus the driver calls; the CPU-side functions (``segments``,
``copies``, ``template``) are tested without CUDA.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
from numba import njit

from .hostreg import CUDA_MEMCPY_DEFAULT, cudart_lib

MAX_PITCH = 1 << 30
"""The widest stride a run's 2-D copy takes (the driver refuses pitches past ~2 GiB)."""

MAX_CALLS = 256
"""Most 2-D copies one transfer may take on this path (~1.5-2 µs of host time each through
ctypes) where the gather path has to stage (no Triton); beyond it, its few large DMAs cost
less host time."""

ZEROCOPY_MAX_CALLS = 16
"""Most 2-D copies one transfer takes on this path where the zero-copy kernel can take it
instead (``Copier.have_triton``). One 2-D copy cost ~4.7 µs of host time on the H100 host
(56 copies of 32 scattered blocks: 260-265 µs) and the kernel ~60 µs (its table's upload and
the launch) plus ~0.85-0.9x the raw device rate, so past ~16 copies the kernel finishes
first: 97-100 µs for those 32 blocks against 264-269 (``bench/copy_batch.py``,
``bench/results/gpu-20261207-s48``)."""

BATCH_ENV = "TRACT_CUDA_BATCH"
"""``off`` (default): never batch; ``auto``: batch a plan of more than ``BATCH_MIN_CALLS`` 2-D
copies; ``all``: every plan of more than one block (module docstring, "Batches")."""

BATCH_MODES = ("auto", "off", "all")

BATCH_MIN_CALLS = 16
"""``auto`` batches a plan that would take more 2-D copies than this (more than eight runs of a
layer: ~32 µs of driver calls). Fewer runs stay 2-D copies, which the copy engine moves as a
few large operations, until ``bench/copy_batch.py`` has shown on a GPU what a batch of many
32 KiB copies costs the device against them (written without a GPU: conservative)."""

BATCH_MAX_COPIES = 4096
"""Most 1-D copies in one batch (a 213-block layer is 426; the whole-block planes of a large
request, 64 per block, keep the 2-D copies or the gather path)."""


WHOLE_ENV = "TRACT_CUDA_WHOLE"
"""``planes`` (default): a whole-block transfer is one 2-D copy per plane per run; ``blocks``:
one 2-D copy per block (module docstring)."""

WHOLE_MODES = ("planes", "blocks")


def _env_choice(env: str, modes: tuple[str, ...], default: str) -> str:
    """One of ``modes`` from the environment variable ``env`` (unset or empty: ``default``;
    ValueError for another value)."""
    m = os.environ.get(env, default) or default
    if m not in modes:
        raise ValueError(f"{env} must be one of {modes}, got {m!r}")
    return m


def whole_mode() -> str:
    """The whole-block copy pattern from ``TRACT_CUDA_WHOLE`` (ValueError for another value)."""
    return _env_choice(WHOLE_ENV, WHOLE_MODES, "planes")


def batch_mode() -> str:
    """The batch policy from ``TRACT_CUDA_BATCH`` (ValueError for another value)."""
    return _env_choice(BATCH_ENV, BATCH_MODES, "off")


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (CUDA 13.0 ``driver_types.h``): 24 bytes."""
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


SRC_ACCESS_ORDER_STREAM = 1
"""``cudaMemcpySrcAccessOrderStream``: the sources are read in stream order (after what the
stream waited for), as every copy of this module must."""

_ATTRS = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM)
_ATTR_IDX = (ctypes.c_size_t * 1)(0)
_ATTRS_PTR = ctypes.addressof(_ATTRS)
_ATTR_IDX_PTR = ctypes.addressof(_ATTR_IDX)


def memcpy_batch(fc: Any, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray,
                 stream_handle: int) -> int:
    """One ``cudaMemcpyBatchAsync`` of ``len(sizes)`` 1-D copies (addresses as int64 arrays,
    sizes uint64), read in stream order. Returns the cudaError (0: enqueued)."""
    return fc.memcpy_batch(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, sizes.shape[0],
                           _ATTRS_PTR, _ATTR_IDX_PTR, 1, stream_handle)


def batch_probe(fc: Any, device: Any, stream: Any) -> str | None:
    """Whether the driver runs batched copies: two 64-byte device copies in one batch on the
    stream, synchronized and compared. None when they did, else why not (``Copier`` then keeps
    the 2-D copies)."""
    if fc is None or getattr(fc, "memcpy_batch", None) is None:
        return "cudaMemcpyBatchAsync not in this CUDA runtime (needs 13.0)"
    import torch
    src = torch.arange(32, dtype=torch.int32, device=device)
    dst = torch.zeros(32, dtype=torch.int32, device=device)
    torch.cuda.current_stream(device).synchronize()
    a, b = src.data_ptr(), dst.data_ptr()
    err = memcpy_batch(fc, np.array([b + 64, b], dtype=np.int64),
                       np.array([a + 64, a], dtype=np.int64),
                       np.array([64, 64], dtype=np.uint64), int(stream.cuda_stream))
    if err:
        return f"cudaMemcpyBatchAsync failed with cudaError {err}"
    stream.synchronize()
    if not torch.equal(src, dst):
        return "cudaMemcpyBatchAsync copied other bytes than asked"
    return None


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

    __slots__ = ("calls", "half", "nbytes", "batch")

    def __init__(self, calls: list[tuple[int, int, int, int, int, int]], half: int,
                 nbytes: int, batch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                 ) -> None:
        self.calls = calls
        self.half = half
        self.nbytes = nbytes
        self.batch = batch
        """Instead of ``calls``: one batch of 1-D copies, (region addresses, tensor addresses,
        sizes) (module docstring, "Batches")."""

    @property
    def rows(self) -> np.ndarray:
        """The copies as an int64 array, one row per copy in ``calls``' form (a batch's 1-D
        copies as one-row copies)."""
        b = self.batch
        if b is not None:
            reg, ten, sizes = b
            w = sizes.astype(np.int64)
            return np.stack([reg, w, ten, w, w, np.ones_like(w)], axis=1)
        return np.array(self.calls, dtype=np.int64).reshape(-1, 6)

    def __len__(self) -> int:
        """The driver calls this transfer takes."""
        return 1 if self.batch is not None else len(self.calls)


class Template:
    """The copies of a transfer with the layer and the tensor's address left open.

    Why. Every layer of a layer-streamed put or get moves the same blocks: the same payload
    offsets, so the same runs and the same copies, shifted by ``layer * layer_bytes`` in the
    region and by the layer tensor's address. Planning them (``segments`` + ``copies``: two
    Numba dispatches and the array work, ~6 µs on the 2-core VM and 2-3x that on the GPU hosts)
    once per request leaves two additions per copy for each later layer (``at``)."""

    __slots__ = ("calls", "half", "nbytes", "layer_bytes", "poffs", "whole", "batch")

    def __init__(self, calls: list[tuple[int, int, int, int, int, int]], half: int, nbytes: int,
                 layer_bytes: int, poffs: np.ndarray, whole: bool,
                 batch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        self.calls = calls
        self.half = half
        self.nbytes = nbytes
        self.layer_bytes = layer_bytes
        self.poffs = poffs
        self.whole = whole
        self.batch = batch
        """Instead of ``calls``: the batch's (region addresses at layer 0, tensor offsets,
        sizes)."""

    def at(self, layer: int | None, tensor_ptr: int) -> DirectCopy:
        """The copies for ``layer`` (None: a whole-block tensor) from / to ``tensor_ptr``."""
        d = 0 if layer is None else layer * self.layer_bytes
        b = self.batch
        if b is not None:
            reg, ten, sizes = b
            return DirectCopy([], self.half, self.nbytes, (reg + d, ten + tensor_ptr, sizes))
        return DirectCopy([(r + d, rp, tensor_ptr + t, tp, w, h)
                           for r, rp, t, tp, w, h in self.calls], self.half, self.nbytes)


def template(layout: Any, poffs: np.ndarray, whole: bool, region_ptr: int,
             batch: str = "off", max_calls: int = MAX_CALLS,
             whole_pattern: str = "planes") -> Template | None:
    """The copies of blocks ``poffs`` (tensor order) at layer 0 and tensor address 0: one
    layer's two planes, or (``whole``) every layer's. ``batch``: the policy where batched
    copies are available (``BATCH_MODES``; ``off`` where they are not). None when one layer's
    copies would take more than ``max_calls`` 2-D copies (whole blocks: ``MAX_CALLS``) and no
    batch (use the gather path). ``whole_pattern``: ``blocks`` moves whole blocks one 2-D copy
    per block (``block_copies``), ``planes`` one per plane per run."""
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
    if whole and whole_pattern == "blocks" and n <= MAX_CALLS:
        return Template(block_copies(poffs, planes, half, region_ptr), half, nbytes,
                        layout.layer_bytes, poffs, whole)
    segs = segments(poffs, span)
    ncalls = segs.shape[0] * planes
    if (batch != "off" and n * planes <= BATCH_MAX_COPIES
            and (batch == "all" or ncalls > BATCH_MIN_CALLS)):
        return Template([], half, nbytes, layout.layer_bytes, poffs, whole,
                        batch_copies(poffs, planes, half, region_ptr))
    if ncalls > (max_calls if not whole else MAX_CALLS):   # (whole blocks: 64 planes a run,
        return None                                          # 2-D copies of MiBs each)
    rows = copies(segs, poffs, n, planes, half, 0, 0, region_ptr)
    calls = [(r, rp, t, tp, half, h) for r, rp, t, tp, h in rows.tolist()]
    return Template(calls, half, nbytes, layout.layer_bytes, poffs, whole)


def block_copies(poffs: np.ndarray, planes: int, half: int,
                 region_ptr: int) -> list[tuple[int, int, int, int, int, int]]:
    """One 2-D copy per block at layer 0 and tensor address 0, in ``Template.calls``' form:
    block ``j``'s ``planes`` rows are tensor rows ``p*n + j`` (pitch ``n*half``) and region
    bytes ``poffs[j] + p*half`` (pitch ``half``: contiguous), as in ``copies``."""
    n = poffs.shape[0]
    return [(region_ptr + off, half, j * half, n * half, half, planes)
            for j, off in enumerate(poffs.tolist())]


def batch_copies(poffs: np.ndarray, planes: int, half: int,
                 region_ptr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One 1-D copy per block and plane at layer 0 and tensor address 0: (region addresses,
    tensor offsets, sizes). Plane ``p`` of block ``j`` is tensor row ``p*n + j`` and region
    bytes ``poffs[j] + p*half`` (as in ``copies``); copies in tensor order."""
    n = poffs.shape[0]
    p = np.arange(planes, dtype=np.int64)[:, None] * half
    reg = (region_ptr + poffs.astype(np.int64)[None, :] + p).reshape(-1)
    ten = (p * n + np.arange(n, dtype=np.int64)[None, :] * half).reshape(-1)
    return reg, ten, np.full(n * planes, half, dtype=np.uint64)


def plan(layout: Any, poffs: np.ndarray, layer: int | None, tensor_ptr: int,
         region_ptr: int, batch: str = "off", max_calls: int = MAX_CALLS,
         whole_pattern: str = "planes") -> DirectCopy | None:
    """The copies moving blocks ``poffs`` (tensor order) of a contiguous tensor at
    ``tensor_ptr``: one layer's planes or all of them (``batch``, ``max_calls``,
    ``whole_pattern``: as ``template``). None when they would take more than ``max_calls``
    copies and no batch (use the gather path)."""
    t = template(layout, poffs, layer is None, region_ptr, batch, max_calls, whole_pattern)
    return None if t is None else t.at(layer, tensor_ptr)


_NONE = object()


class TemplateCache:
    """The templates of the last few transfers' payload offsets, for one layout and region.

    A put's later layers pass the very array of its batch (``FillBatch.offsets``: found by
    identity); a get's pass a fresh snapshot of the same offsets (found by length, first
    element and one array comparison). Offsets that need the gather path are remembered too
    (as None). ``size`` entries: a few requests streaming at once."""

    def __init__(self, layout: Any, region_ptr: int, size: int = 8, batch: str = "off",
                 max_calls: int = MAX_CALLS, whole_pattern: str = "planes") -> None:
        self.layout = layout
        self.region_ptr = region_ptr
        self.size = size
        self.batch = batch
        self.max_calls = max_calls
        self.whole_pattern = whole_pattern
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
        t = template(self.layout, poffs, whole, self.region_ptr, self.batch, self.max_calls,
                     self.whole_pattern)
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
    b = dc.batch
    if b is not None:
        if fc is None or getattr(fc, "memcpy_batch", None) is None:
            raise RuntimeError("a batched plan needs cudaMemcpyBatchAsync (events.FastCalls)")
        reg, ten, sizes = b
        dst, src = (reg, ten) if to_region else (ten, reg)
        err = memcpy_batch(fc, dst, src, sizes, stream_handle)
        if err:
            raise RuntimeError(f"cudaMemcpyBatchAsync failed with cudaError {err} "
                               f"({sizes.shape[0]} copies, to_region={to_region})")
        return 1
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
