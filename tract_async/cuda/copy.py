"""Executing a RowPlan between device tensors and the registered region.

A contiguous KV tensor whose blocks sit at evenly spaced payload offsets (the usual case: a
request's blocks are reserved together) takes neither staging nor plan: ``direct`` is one 2-D
copy per K/V plane per run of blocks (``cuda/direct.py``; ``put_direct``/``get_direct``).

Otherwise three ways to move a plan, chosen per transfer (``method="auto"``) or forced:

* ``dma``: gather the rows into a contiguous device staging buffer in region order (one strided
  copy when the plan is affine, else ``index_select``/``index_copy_``; skipped when the source
  rows are already in region order), then one ``cudaMemcpyAsync`` per contiguous region run.
  Blocks of a request are usually allocated back to back, so a whole put is one or a few DMAs
  at the link's full speed. Large transfers go in pieces (``piece_bytes``): the gather of piece
  k+1 runs on the transform stream while the DMA of piece k runs on the DMA stream.
* ``dma2d``: same gather, then one ``cudaMemcpy2DAsync`` when the runs are equally long and
  equally spaced: one layer of many blocks (64 KiB every 2 MiB for Llama-3-8B) in a single
  copy-engine operation instead of a copy per block (per-block copies reach ~8 GB/s).
* ``zerocopy``: a Triton kernel reads the rows where they are and stores straight into the
  mapped region (or loads from it): no staging, one launch (see ``triton_copy``).

Gets run the same steps backwards: DMA region -> staging (or straight into the destination when
it is in region order), then a scatter on the transform stream.

Streams: each direction has a DMA stream and a transform stream (high priority, so that a gather
is not stuck behind long compute kernels). A put's first step waits on the producer's event
(``cudaStreamWaitEvent``: the host never blocks). Every tensor a transfer touches is kept alive
by its StreamFuture until its final event completed.

Without registration (``HostRegistration.registered`` False) the region is not addressable by
the device: ``d2h_pinned``/``h2d_pinned`` then move the gathered bytes through a pinned host buffer
and the caller does the CPU copy (see ``store``).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import numpy as np

from . import direct, tables
from .hostreg import HostRegistration, cudart_lib, memcpy2d_async

METHODS = ("auto", "direct", "dma", "dma2d", "zerocopy")
ENV_METHOD = "TRACT_CUDA_COPY"
"""Force a method for every transfer (``dma``, ``dma2d``, ``zerocopy``); default ``auto``."""

LARGE_RUN_BYTES = 1 << 20

NO_WAIT = object()
"""``ready``/``after`` value meaning: wait for nothing (the engine allocated the tensor)."""


@dataclasses.dataclass
class CopyCounters:
    transfers: int = 0
    bytes: int = 0
    dma_calls: int = 0
    dma2d_calls: int = 0
    batch_calls: int = 0
    batch_copies: int = 0
    kernel_launches: int = 0
    gathers: int = 0
    by_method: dict[str, int] = dataclasses.field(default_factory=dict)


def rows_view(t: Any, row_bytes: int) -> Any:
    """A contiguous tensor as ``(rows, words)`` with the widest word dividing ``row_bytes`` and
    the tensor's alignment (int64, int32 or uint8). Raises ValueError if not contiguous."""
    import torch
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    u8 = t.reshape(-1).view(torch.uint8)
    if u8.numel() % row_bytes:
        raise ValueError(f"tensor of {u8.numel()} bytes is not whole rows of {row_bytes}")
    for dt, w in ((torch.int64, 8), (torch.int32, 4)):
        if row_bytes % w == 0 and t.data_ptr() % w == 0:
            return u8.view(-1, row_bytes).view(dt)
    return u8.view(-1, row_bytes)


def choose(method: str, runs: tables.Runs, row_bytes: int, *, have_2d: bool,
           have_triton: bool) -> str:
    """The method ``auto`` picks for these runs (see the module docstring)."""
    if method not in ("auto", "direct"):     # ("direct" not possible here: as auto)
        return method
    total = int(runs.nbytes.sum()) if len(runs) else 0
    if len(runs) <= 4 or total // max(1, len(runs)) >= LARGE_RUN_BYTES:
        return "dma"
    if have_2d and runs.uniform_stride() is not None:
        return "dma2d"
    if have_triton and row_bytes % 16 == 0:
        return "zerocopy"
    return "dma"


class Copier:
    """Copy streams and the three methods for one device and one registered region."""

    def __init__(self, reg: HostRegistration, device: Any, *, method: str | None = None,
                 piece_bytes: int = 32 << 20) -> None:
        import torch
        self.torch = torch
        self.reg = reg
        self.device = torch.device(device)
        m = method or os.environ.get(ENV_METHOD, "auto") or "auto"
        if m not in METHODS:
            raise ValueError(f"copy method must be one of {METHODS}, got {m!r}")
        self.method = m
        self.piece_bytes = piece_bytes
        with torch.cuda.device(self.device):
            self.put_xform = torch.cuda.Stream(self.device, priority=-1)
            self.put_dma = torch.cuda.Stream(self.device)
            self.get_dma = torch.cuda.Stream(self.device)
            self.get_xform = torch.cuda.Stream(self.device, priority=-1)
        self._put_dma_h = int(self.put_dma.cuda_stream)
        self._get_dma_h = int(self.get_dma.cuda_stream)
        self.region_u8 = reg.tensor
        self.region_ptr = reg.ptr
        self.have_2d = reg.registered and cudart_lib() is not None
        from . import triton_copy
        ok, why = triton_copy.available()
        self.have_triton = reg.registered and ok
        self.triton_reason = why
        self.counters = CopyCounters()
        # the direct path's raw events and GIL-holding enqueue calls (cuda/events.py)
        from . import events
        self.fast = events.fast_calls() if self.have_2d else None
        self.events: Any = None
        self._put_order: Any = None
        self._get_order: Any = None
        if self.fast is not None:
            idx = self.device.index if self.device.index is not None else \
                torch.cuda.current_device()
            self.events = events.EventPool(self.fast, self.device)
            self._put_order = events.StreamOrder(self.events, idx)
            self._get_order = events.StreamOrder(self.events, idx)
        self._templates: dict[int, Any] = {}
        # batched copies for plans of many runs (cuda/direct.py, "Batches"): the policy, or
        # "off" with the reason where the runtime or the driver has none
        mode = direct.batch_mode()
        if mode == "off":
            self.batch_reason: str | None = f"off ({direct.BATCH_ENV})"
        elif not self.have_2d:
            self.batch_reason = "the region is not registered"
        else:
            self.batch_reason = direct.batch_probe(self.fast, self.device, self.put_dma)
        self.batch = mode if self.batch_reason is None else "off"
        self.whole = direct.whole_mode()
        """Whole-block transfers by plane or by block (``cuda/direct.py``,
        ``TRACT_CUDA_WHOLE``)."""
        self.zerocopy_warm_s: dict[int, float] = {}   # row bytes -> seconds its compile took

    def warm_zerocopy(self, row_bytes: int) -> None:
        """Compile the zero-copy kernel for rows of ``row_bytes`` now, with one launch between
        two scratch device tensors (the same argument specialization as a region copy: int32
        anchors and a table, 16-byte aligned, the same ``row_words``).

        Why: ``auto`` takes the zero-copy path only for scattered rows, which a region meets
        once evictions have freed slots here and there; Triton then compiled the kernel inside
        that put, on the serving path: layer 0 of one region-cache request took 1.1 and 2.2 s
        between its reservation and its enqueue on two H100 hosts
        (``bench/results/gpu-20261206-s40``, calls 3 and 4), the first time in each prefill
        worker. No-op without Triton or for rows it cannot copy."""
        from . import triton_copy
        if (not self.have_triton or row_bytes in self.zerocopy_warm_s
                or not triton_copy.supported(row_bytes)):
            return
        torch = self.torch
        t0 = time.perf_counter()
        words = row_bytes // 4
        with torch.cuda.device(self.device):
            src = torch.zeros(words, dtype=torch.int32, device=self.device)
            dst = torch.empty(words, dtype=torch.int32, device=self.device)
            table = torch.zeros((1, 2), dtype=torch.int64, device=self.device)
            triton_copy.copy_rows(src, dst, table, row_bytes)
            torch.cuda.current_stream(self.device).synchronize()
        self.zerocopy_warm_s[row_bytes] = time.perf_counter() - t0

    # -- helpers ------------------------------------------------------------------------------
    def _event(self, stream: Any) -> Any:
        ev = self.torch.cuda.Event()
        ev.record(stream)
        return ev

    def producer_event(self, ready: Any) -> Any:
        """An event for the producer's work: ``ready`` as is (Event), recorded on it (Stream),
        or recorded now on the current stream (None)."""
        torch = self.torch
        if ready is NO_WAIT:
            return None
        if isinstance(ready, torch.cuda.Event):
            return ready
        stream = ready if ready is not None else torch.cuda.current_stream(self.device)
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _pinned_indices(self, arrays: Sequence[np.ndarray], stream: Any) -> list[Any]:
        """Upload int64 index arrays in one pinned H2D copy on ``stream`` (a pageable upload
        would make the host wait for the stream)."""
        torch = self.torch
        sizes = [int(a.size) for a in arrays]
        flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]) \
            if arrays else np.zeros(0, dtype=np.int64)
        host = torch.from_numpy(flat).pin_memory()
        with torch.cuda.stream(stream):
            dev = host.to(self.device, non_blocking=True)
        out, at = [], 0
        for s in sizes:
            out.append(dev[at:at + s])
            at += s
        return out

    def _check_sources(self, tensors: Sequence[Any], what: str) -> None:
        for t in tensors:
            if t.device != self.device:
                from ..errors import TensorMismatch
                raise TensorMismatch(f"{what} is on {t.device}; this engine's copy streams are "
                                     f"on {self.device}")

    # -- shared planning ----------------------------------------------------------------------
    def _prepare(self, plan: tables.RowPlan, tensors: Sequence[Any], planes: int) -> dict:
        rb = plan.row_bytes
        views = [rows_view(t, rb) for t in tensors]
        runs = tables.runs_of(plan)
        aff = tables.affine_of(plan, planes)
        identity = aff is not None and (
            (aff.planes == 1 or aff.plane_stride == 1) and
            (aff.blocks == 1 or aff.block_stride == aff.planes))
        return {"views": views, "runs": runs, "affine": aff, "identity": identity}

    def _affine_view(self, views: list[Any], aff: tables.Affine) -> Any:
        v = views[aff.src]
        w = v.shape[1]
        return v.as_strided((aff.blocks, aff.planes, w),
                            (aff.block_stride * w, aff.plane_stride * w, 1),
                            v.storage_offset() + aff.base * w)

    def _index_parts(self, plan: tables.RowPlan, lo: int, hi: int) -> list[tuple[int, np.ndarray,
                                                                                  np.ndarray]]:
        """Per source in rows [lo, hi): (source, plan positions, source rows)."""
        seg_src = plan.src[lo:hi]
        out = []
        for t in np.unique(seg_src).tolist():
            pos = np.flatnonzero(seg_src == t) + lo
            out.append((int(t), pos, plan.row[pos]))
        return out

    def _dma_runs(self, runs: tables.Runs, base: Any, stream: Any, to_region: bool,
                  use_2d: bool) -> None:
        """Issue the copies of ``runs`` between the region and the device tensor ``base``
        (contiguous, holding plan row 0 first)."""
        if len(runs) == 0:
            return
        rb = runs.row_bytes
        st = runs.uniform_stride() if use_2d and len(runs) > 1 else None
        if st is not None:        # (a piece boundary may cut runs unevenly: then per run)
            stride, run_bytes = st
            reg = self.region_ptr + int(runs.region_off[0])
            dev = base.data_ptr() + int(runs.first[0]) * rb
            if to_region:
                memcpy2d_async(reg, stride, dev, run_bytes, run_bytes, len(runs), stream.cuda_stream)
            else:
                memcpy2d_async(dev, run_bytes, reg, stride, run_bytes, len(runs), stream.cuda_stream)
            self.counters.dma2d_calls += 1
            return
        torch = self.torch
        base_u8 = base.reshape(-1).view(torch.uint8)
        with torch.cuda.stream(stream):
            for ro, first, cnt in zip(runs.region_off.tolist(), runs.first.tolist(),
                                      runs.count.tolist()):
                nb = cnt * rb
                dev_t = base_u8[first * rb:first * rb + nb]
                reg_t = self.region_u8[ro:ro + nb]
                if to_region:
                    reg_t.copy_(dev_t, non_blocking=True)
                else:
                    dev_t.copy_(reg_t, non_blocking=True)
                self.counters.dma_calls += 1

    # -- direct: contiguous tensors, 2-D copies (cuda/direct.py) -------------------------------
    def wants_direct(self, method: str | None) -> bool:
        """Whether a contiguous tensor's transfer may take the direct 2-D copies: the method is
        ``auto`` or ``direct`` and 2-D copies are reachable."""
        m = method or self.method
        return self.have_2d and (m == "auto" or m == "direct")

    def direct_template(self, layout: Any, poffs: np.ndarray, whole: bool) -> Any:
        """The ``direct.Template`` of blocks ``poffs`` (one layer's planes, or every layer's
        for ``whole``) from this copier's template cache (one per layout): a request's later
        layers reuse its first layer's copies. None: the gather path."""
        cache = self._templates.get(id(layout))
        if cache is None or cache.layout is not layout:
            from . import triton_copy
            cache = self._templates[id(layout)] = direct.TemplateCache(
                layout, self.region_ptr, batch=self.batch, whole_pattern=self.whole,
                max_calls=(direct.ZEROCOPY_MAX_CALLS if self.have_triton
                           and triton_copy.supported(layout.half_layer_bytes)
                           else direct.MAX_CALLS))
        return cache.get(poffs, whole)

    def put_direct(self, dc: Any, tensor: Any, ready: Any) -> tuple[Any, tuple[Any, ...]]:
        """Enqueue ``dc`` (``direct.plan``) from ``tensor`` into the region after ``ready`` on
        the put stream. Returns (final event, keep)."""
        return self._direct(dc, tensor, ready, self.put_dma, self._put_dma_h, True, "kv",
                            self._put_order)

    def get_direct(self, dc: Any, tensor: Any, after: Any) -> tuple[Any, tuple[Any, ...]]:
        """Enqueue ``dc`` from the region into ``tensor`` after ``after`` on the get stream."""
        return self._direct(dc, tensor, after, self.get_dma, self._get_dma_h, False, "out",
                            self._get_order)

    def _direct(self, dc: Any, tensor: Any, wait_for: Any, stream: Any, handle: int,
                to_region: bool, what: str, order: Any) -> tuple[Any, tuple[Any, ...]]:
        if tensor.device != self.device:
            self._check_sources((tensor,), what)
        fc = self.fast
        if fc is None:                      # torch's events and streams, CDLL calls
            _wait(stream, self.producer_event(wait_for))
            self.counters.dma2d_calls += direct.issue(dc, handle, to_region=to_region)
            self._count("direct", dc.nbytes)
            return self._event(stream), (tensor,)
        if wait_for is None:                # the caller's current stream, by its raw handle
            order.after_current(handle)
        elif wait_for is not NO_WAIT:
            self._wait_raw(stream, handle, wait_for)
        calls = direct.issue(dc, handle, to_region=to_region, fc=fc)
        if dc.batch is not None:
            self.counters.batch_calls += calls
            self.counters.batch_copies += dc.batch[2].shape[0]
        else:
            self.counters.dma2d_calls += calls
        self._count("direct", dc.nbytes)
        return self.events.take().record(handle), (tensor,)

    def _wait_raw(self, stream: Any, handle: int, wait_for: Any) -> None:
        """``stream`` waits for ``wait_for``: a torch Event, a raw event, or a torch Stream."""
        w = getattr(wait_for, "wait_on", None)
        if w is not None:
            w(handle)
        else:
            _wait(stream, self.producer_event(wait_for))

    def _count(self, method: str, nbytes: int) -> None:
        c = self.counters
        c.transfers += 1
        c.bytes += nbytes
        c.by_method[method] = c.by_method.get(method, 0) + 1

    # -- put: device -> region ----------------------------------------------------------------
    def put(self, plan: tables.RowPlan, tensors: Sequence[Any], *, planes: int, ready: Any = None,
            method: str | None = None) -> tuple[Any, tuple[Any, ...], str]:
        """Enqueue the copy of ``plan`` from ``tensors`` into the region after ``ready``.
        Returns (final event, tensors to keep alive until it completes, method used)."""
        torch = self.torch
        self._check_sources(tensors, "kv")
        prep = self._prepare(plan, tensors, planes)
        runs: tables.Runs = prep["runs"]
        m = choose(method or self.method, runs, plan.row_bytes, have_2d=self.have_2d,
                   have_triton=self.have_triton)
        m = self._available(m, plan)
        ev_ready = self.producer_event(ready)
        keep: list[Any] = [*tensors]
        self.counters.transfers += 1
        self.counters.bytes += plan.nbytes
        self.counters.by_method[m] = self.counters.by_method.get(m, 0) + 1
        if len(plan) == 0:
            return self._event(self.put_dma), tuple(keep), m
        if m == "zerocopy":
            tbl = self._zerocopy_table(plan, prep["views"], device_to_region=True)
            (tdev,) = self._pinned_indices([tbl.reshape(-1)], self.put_dma)
            _wait(self.put_dma, ev_ready)
            with torch.cuda.stream(self.put_dma):
                from . import triton_copy
                triton_copy.copy_rows(prep["views"][0].view(torch.int32),
                                      self.region_u8.view(torch.int32), tdev.view(-1, 2),
                                      plan.row_bytes)
            self.counters.kernel_launches += 1
            keep.append(tdev)
            return self._event(self.put_dma), tuple(keep), m
        use_2d = m == "dma2d"
        if prep["identity"]:
            aff = prep["affine"]
            base = prep["views"][aff.src][aff.base:]
            _wait(self.put_dma, ev_ready)
            self._dma_runs(runs, base, self.put_dma, True, use_2d)
            return self._event(self.put_dma), tuple(keep), m
        staging, parts = self._gather(plan, prep, planes, ev_ready, keep)
        for (lo, hi), ev in parts:
            self.put_dma.wait_event(ev)
            self._dma_runs(tables.split_runs(runs, lo, hi) if len(parts) > 1 else runs,
                           staging, self.put_dma, True, use_2d)
        return self._event(self.put_dma), tuple(keep), m

    def _available(self, m: str, plan: tables.RowPlan) -> str:
        if m == "zerocopy" and not (self.have_triton and self._zerocopy_aligned(plan)):
            return "dma"
        if m == "dma2d" and not self.have_2d:
            return "dma"
        return m

    def _zerocopy_aligned(self, plan: tables.RowPlan) -> bool:
        from . import triton_copy
        return triton_copy.supported(plan.row_bytes) and not (plan.region_off % 16).any()

    def _zerocopy_table(self, plan: tables.RowPlan, views: list[Any], *,
                        device_to_region: bool) -> np.ndarray:
        rb = plan.row_bytes
        ptrs = np.array([v.data_ptr() for v in views], dtype=np.int64)
        if (ptrs % 16).any():
            raise AssertionError("cuda.copy: zerocopy needs 16-byte aligned tensors")
        dev_rel = (ptrs[plan.src] - ptrs[0]) + plan.row * rb
        reg_rel = plan.region_off
        tbl = np.empty((len(plan), 2), dtype=np.int64)
        if device_to_region:
            tbl[:, 0], tbl[:, 1] = dev_rel // 16, reg_rel // 16
        else:
            tbl[:, 0], tbl[:, 1] = reg_rel // 16, dev_rel // 16
        return tbl

    def _gather(self, plan: tables.RowPlan, prep: dict, planes: int, ev_ready: Any,
                keep: list[Any]) -> tuple[Any, list[tuple[tuple[int, int], Any]]]:
        """Gather rows into a new staging buffer in plan order, piece by piece on the transform
        stream; returns the buffer and ((row_lo, row_hi), event) per piece."""
        torch = self.torch
        views = prep["views"]
        aff = prep["affine"]
        w, dt = views[0].shape[1], views[0].dtype
        xs = self.put_xform
        nblocks = len(plan) // planes
        ps = tables.pieces(nblocks, planes, plan.row_bytes, self.piece_bytes)
        idx = None
        if aff is None:
            parts_np = [self._index_parts(plan, a * planes, b * planes) for a, b in ps]
            flat = [x for part in parts_np for (_, pos, rows) in part for x in (pos, rows)]
            idx = iter(self._pinned_indices(flat, xs))
        with torch.cuda.stream(xs):
            staging = torch.empty((len(plan), w), dtype=dt, device=self.device)
        keep.append(staging)
        _wait(xs, ev_ready)
        out = []
        src_view = self._affine_view(views, aff) if aff is not None else None
        for pi, (a, b) in enumerate(ps):
            lo, hi = a * planes, b * planes
            with torch.cuda.stream(xs):
                if aff is not None:
                    staging[lo:hi].view(b - a, planes, w).copy_(src_view[a:b])
                else:
                    for t, _, _ in parts_np[pi]:
                        pos_d, rows_d = next(idx), next(idx)
                        keep.extend((pos_d, rows_d))
                        if len(views) == 1:
                            torch.index_select(views[t], 0, rows_d, out=staging[lo:hi])
                        else:
                            staging.index_copy_(0, pos_d, views[t].index_select(0, rows_d))
                self.counters.gathers += 1
            out.append(((lo, hi), self._event(xs)))
        return staging, out

    # -- get: region -> device ----------------------------------------------------------------
    def get(self, plan: tables.RowPlan, tensors: Sequence[Any], *, planes: int,
            method: str | None = None, after: Any = None) -> tuple[Any, tuple[Any, ...], str]:
        """Enqueue the copy of ``plan`` from the region into ``tensors`` (after ``after``, an
        event, if given: e.g. the consumer's last use of the buffer). Returns (final event,
        keep, method)."""
        torch = self.torch
        self._check_sources(tensors, "out")
        prep = self._prepare(plan, tensors, planes)
        runs: tables.Runs = prep["runs"]
        m = choose(method or self.method, runs, plan.row_bytes, have_2d=self.have_2d,
                   have_triton=self.have_triton)
        m = self._available(m, plan)
        keep: list[Any] = [*tensors]
        self.counters.transfers += 1
        self.counters.bytes += plan.nbytes
        self.counters.by_method[m] = self.counters.by_method.get(m, 0) + 1
        ev_after = self.producer_event(after)
        if len(plan) == 0:
            return self._event(self.get_dma), tuple(keep), m
        if m == "zerocopy":
            tbl = self._zerocopy_table(plan, prep["views"], device_to_region=False)
            (tdev,) = self._pinned_indices([tbl.reshape(-1)], self.get_dma)
            _wait(self.get_dma, ev_after)
            with torch.cuda.stream(self.get_dma):
                from . import triton_copy
                triton_copy.copy_rows(self.region_u8.view(torch.int32),
                                      prep["views"][0].view(torch.int32), tdev.view(-1, 2),
                                      plan.row_bytes)
            self.counters.kernel_launches += 1
            keep.append(tdev)
            return self._event(self.get_dma), tuple(keep), m
        use_2d = m == "dma2d"
        _wait(self.get_dma, ev_after)
        if prep["identity"]:
            aff = prep["affine"]
            base = prep["views"][aff.src][aff.base:]
            self._dma_runs(runs, base, self.get_dma, False, use_2d)
            return self._event(self.get_dma), tuple(keep), m
        staging, final = self._scatter(plan, prep, planes, runs, use_2d, keep)
        return final, tuple(keep), m

    def _scatter(self, plan: tables.RowPlan, prep: dict, planes: int, runs: tables.Runs,
                 use_2d: bool, keep: list[Any]) -> tuple[Any, Any]:
        torch = self.torch
        views = prep["views"]
        aff = prep["affine"]
        w, dt = views[0].shape[1], views[0].dtype
        xs, ds = self.get_xform, self.get_dma
        nblocks = len(plan) // planes
        ps = tables.pieces(nblocks, planes, plan.row_bytes, self.piece_bytes)
        parts_np = None
        idx = None
        if aff is None:
            parts_np = [self._index_parts(plan, a * planes, b * planes) for a, b in ps]
            flat = [x for part in parts_np for (_, pos, rows) in part for x in (pos, rows)]
            idx = iter(self._pinned_indices(flat, xs))
        with torch.cuda.stream(ds):
            staging = torch.empty((len(plan), w), dtype=dt, device=self.device)
        keep.append(staging)
        dst_view = self._affine_view(views, aff) if aff is not None else None
        for pi, (a, b) in enumerate(ps):
            lo, hi = a * planes, b * planes
            self._dma_runs(tables.split_runs(runs, lo, hi) if len(ps) > 1 else runs,
                           staging, ds, False, use_2d)
            xs.wait_event(self._event(ds))
            with torch.cuda.stream(xs):
                if aff is not None:
                    dst_view[a:b].copy_(staging[lo:hi].view(b - a, planes, w))
                else:
                    for t, _, _ in parts_np[pi]:
                        pos_d, rows_d = next(idx), next(idx)
                        keep.extend((pos_d, rows_d))
                        if len(views) == 1:
                            views[t].index_copy_(0, rows_d, staging[lo:hi])
                        else:
                            views[t].index_copy_(0, rows_d, staging.index_select(0, pos_d))
                self.counters.gathers += 1
        return staging, self._event(xs)

    # -- fallback: no registration ------------------------------------------------------------
    def d2h_pinned(self, plan: tables.RowPlan, tensors: Sequence[Any], *, planes: int,
                   ready: Any = None) -> tuple[Any, tuple[Any, ...], Any]:
        """Gather into staging, one DMA into a new pinned host buffer (plan order). Returns
        (event, keep, pinned uint8 tensor); the caller copies it into the region."""
        torch = self.torch
        self._check_sources(tensors, "kv")
        prep = self._prepare(plan, tensors, planes)
        keep: list[Any] = [*tensors]
        ev_ready = self.producer_event(ready)
        pinned = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
        keep.append(pinned)
        self.counters.transfers += 1
        self.counters.bytes += plan.nbytes
        self.counters.by_method["pinned"] = self.counters.by_method.get("pinned", 0) + 1
        if len(plan) == 0:
            return self._event(self.put_dma), tuple(keep), pinned
        if prep["identity"]:
            aff = prep["affine"]
            src = prep["views"][aff.src][aff.base:aff.base + len(plan)]
            _wait(self.put_dma, ev_ready)
        else:
            saved, self.piece_bytes = self.piece_bytes, 1 << 62      # one piece
            try:
                src, parts = self._gather(plan, prep, planes, ev_ready, keep)
            finally:
                self.piece_bytes = saved
            self.put_dma.wait_event(parts[-1][1])
        with torch.cuda.stream(self.put_dma):
            pinned.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
        self.counters.dma_calls += 1
        return self._event(self.put_dma), tuple(keep), pinned

    def h2d_pinned(self, plan: tables.RowPlan, tensors: Sequence[Any], pinned: Any, *,
                   planes: int) -> tuple[Any, tuple[Any, ...]]:
        """One DMA from a pinned buffer holding the plan's rows (plan order) to staging, then the
        scatter into ``tensors``. Returns (event, keep)."""
        torch = self.torch
        self._check_sources(tensors, "out")
        prep = self._prepare(plan, tensors, planes)
        keep: list[Any] = [*tensors, pinned]
        views = prep["views"]
        w, dt = views[0].shape[1], views[0].dtype
        with torch.cuda.stream(self.get_dma):
            staging = torch.empty((len(plan), w), dtype=dt, device=self.device)
            staging.view(-1).view(torch.uint8).copy_(pinned, non_blocking=True)
        keep.append(staging)
        self.counters.dma_calls += 1
        self.get_xform.wait_event(self._event(self.get_dma))
        aff = prep["affine"]
        with torch.cuda.stream(self.get_xform):
            if aff is not None:
                self._affine_view(views, aff).copy_(
                    staging.view(aff.blocks, aff.planes, w))
            else:
                parts = self._index_parts(plan, 0, len(plan))
                flat = [x for (_, pos, rows) in parts for x in (pos, rows)]
                idx = iter(self._pinned_indices(flat, self.get_xform))
                for t, _, _ in parts:
                    pos_d, rows_d = next(idx), next(idx)
                    keep.extend((pos_d, rows_d))
                    views[t].index_copy_(0, rows_d, staging.index_select(0, pos_d))
        return self._event(self.get_xform), tuple(keep)

    def describe(self) -> dict[str, Any]:
        return {"device": str(self.device), "method": self.method, "dma2d": self.have_2d,
                "zerocopy": self.have_triton, "zerocopy_unavailable": self.triton_reason or None,
                "zerocopy_warm_s": {str(k): round(v, 3) for k, v in self.zerocopy_warm_s.items()},
                "batch": self.batch, "batch_unavailable": self.batch_reason,
                "whole": self.whole,
                "piece_bytes": self.piece_bytes, **dataclasses.asdict(self.counters)}


def _wait(stream: Any, event: Any) -> None:
    if event is not None:
        stream.wait_event(event)
