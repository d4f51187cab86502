"""The CUDA DMA back-end of put / get: the block lifecycle of ``stores/blocks.py`` with device transfers.

Same protocol, same order, as ``RegionStore.put`` / ``RegionStore.get`` (read those first); what
changes is the copy and *when* the metadata steps run:

put:  snapshot -> reserve (global lock, once per batch) -> enqueue gather + DMA on the copy
      streams after the producer's event -> [StreamFuture completion, on the loop, after the
      DMA's event has completed] publish the layer bits (READY after the last layer).
get:  snapshot -> wait for blocks / the layer (``timeout``) -> bounds check -> enqueue DMA +
      scatter -> [completion, after the final event] re-validate every block's version: a
      change is BlockEvicted (a miss), never wrong bytes handed over as good.

A failed or cancelled put evicts its reservations only once its DMA has landed (invariant 7);
a cancelled get returns only once no more bytes can land in ``out``.

``CudaPath`` is the per-engine state: the region's registration, one ``Copier`` per device,
the outstanding futures (drained before the engine closes), and the counters ``stats()`` shows.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

import tract_kernels as K

from ..stores import plan as kvplan
from ..host.gcpause import PAUSE_MIN_BLOCKS, gc_paused
from ..errors import BlockEvicted
from ..region import index as ix
from ..region.index import SNAP_POFF
from ..stores.fillbook import FillBatch
from ..stores.readiness import SMALL_READ
from ..stores.txn import PutTxn, ReadTxn
from ..stores import routing as R
from . import layerstream, tables
from .copy import Copier
from .events import DONE
from .futures import StreamFuture, poller
from .hostreg import HostRegistration

EARLY_ENV = "TRACT_CUDA_EARLY"
"""``0``: no early copies (``_EarlyPut``): every put's DMA starts after its index entries, for
A/B runs."""

SWEEP_ENV = "TRACT_CPUMARKS_SWEEP"
"""``0``: no background sweep of the CPU-cache record (``CudaPath.sweeper``), for A/B runs."""

LINK_BYTES_PER_S = 60e9
"""Upper bound of the link speed: a transfer of N bytes cannot land before N / this (used only
as the poller's "do not look before" hint, so an overestimate is harmless)."""


class CudaPath:
    """Registration, copiers and bookkeeping of one engine's CUDA transfers."""

    def __init__(self, region: Any, *, method: str | None = None,
                 piece_bytes: int = 32 << 20, row_bytes: int | None = None,
                 blocks: Any = None) -> None:
        import torch
        if not torch.cuda.is_available():
            from ..errors import TensorMismatch
            raise TensorMismatch("CUDA tensors were given but torch.cuda is not available")
        self.reg = HostRegistration(region.buf)
        self.method = method
        self.piece_bytes = piece_bytes
        self.row_bytes = row_bytes      # the layout's row (half a block layer): warmed per copier
        self._copiers: dict[Any, Copier] = {}
        self._outstanding: set[StreamFuture] = set()
        self.futures_created = 0
        self.validation_failures = 0
        self.cancelled = 0
        self.early = os.environ.get(EARLY_ENV, "1") != "0"
        """Whether direct puts of many new blocks start their copies before their index
        entries (``_EarlyPut``)."""
        self.early_puts = 0
        """Puts whose copies the reservation started (``_EarlyPut``)."""
        self.streams = layerstream.Streams()
        """The layer streams of requests in flight (``cuda/layerstream.py``)."""
        self.sampler: Any = None
        self.sampler_task: asyncio.Task | None = None   # the engine's (cuda/api.py)
        self.sweeper: Any = None
        """The CPU-cache record's sweeper (``region/cpumarks.py``, ``Sweeper``): this node's
        GPU reads find the granules it got to unmarked, so their first read of a block does not
        invalidate it on the read's path. Started for a region on the hardware backend
        (``blocks``: the region's block lifecycle; None without a region store)."""
        if (blocks is not None and blocks.mem[K.MEM_BACKEND] == K.BACKEND_HW
                and os.environ.get(SWEEP_ENV, "1") != "0"):
            from ..region import cpumarks
            self.sweeper = cpumarks.Sweeper(blocks.cpu_marks, blocks.mem,
                                            ix.S_IX_PAYLOAD_READ)

    @property
    def registered(self) -> bool:
        return self.reg.registered

    def copier(self, device: Any) -> Copier:
        c = self._copiers.get(device)       # a torch.device of a tensor: hashed as it is
        if c is not None:
            return c
        import torch
        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        c = self._copiers.get(dev)
        if c is None:
            c = Copier(self.reg, dev, method=self.method, piece_bytes=self.piece_bytes)
            if self.row_bytes is not None:
                c.warm_zerocopy(self.row_bytes)     # not inside a later put (Copier.warm_zerocopy)
            self._copiers[dev] = c
        return c

    def track(self, fut: StreamFuture) -> StreamFuture:
        self.futures_created += 1
        fut.track_in(self._outstanding)
        return fut

    async def drain(self, timeout: float) -> None:
        """Wait until every transfer has landed (nothing may write the region after this)."""
        pending = [f.landed_future() for f in list(self._outstanding) if not f.seen_landed]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        left = [f for f in self._outstanding if not f.seen_landed]
        for f in left:  # the poller could not tell us in time: block, the memory goes away next
            f.synchronize()

    def close(self) -> None:
        if self.sweeper is not None:     # out of the region before it goes away
            self.sweeper.stop()
        self.reg.close()

    def describe(self) -> dict[str, Any]:
        p = poller()
        out: dict[str, Any] = {**self.reg.describe(),
                               "devices": {str(d): c.describe() for d, c in self._copiers.items()},
                               "futures": self.futures_created,
                               "outstanding": len(self._outstanding),
                               "validation_failures": self.validation_failures,
                               "cancelled": self.cancelled,
                               "early_puts": {"on": self.early, "used": self.early_puts},
                               "layer_streams": {"on": self.streams.on,
                                                 "used": self.streams.used,
                                                 "declined": self.streams.declined},
                               "cpumarks_swept": (None if self.sweeper is None
                                                  else self.sweeper.swept),
                               "poller": {"wakeups": p.wakeups, "queries": p.queries,
                                          "resolved": p.resolved, "skipped": p.skipped,
                                          "running": p.running}}
        if self.sampler is not None:
            out["telemetry"] = self.sampler.summary()
        return out


# ---------------------------------------------------------------------------------------------
# put

PlanFn = Callable[[np.ndarray, np.ndarray], tables.RowPlan]


class ContiguousPlan:
    """The RowPlan builder of a contiguous KV tensor (``PlanFn``), which also says so: such a
    transfer may take the direct 2-D copies of ``cuda/direct.py`` instead of a RowPlan."""

    __slots__ = ("layout", "n", "layer")

    def __init__(self, layout: Any, n: int, layer: int | None) -> None:
        self.layout = layout
        self.n = n
        self.layer = layer

    def __call__(self, poffs: np.ndarray, positions: np.ndarray) -> tables.RowPlan:
        return tables.from_kvplan(kvplan.plan(self.layout, poffs, positions, self.n, self.layer),
                                  self.layout.half_layer_bytes)


def contiguous_plan_fn(layout: Any, n: int, layer: int | None) -> PlanFn:
    return ContiguousPlan(layout, n, layer)


def paged_plan_fn(layout: Any, pool: Any, block_ids: np.ndarray, layer: int | None) -> PlanFn:
    def make(poffs: np.ndarray, positions: np.ndarray) -> tables.RowPlan:
        return pool.plan(layout, poffs, block_ids[positions], layer)
    return make


def planes_of(layout: Any, layer: int | None) -> int:
    return 2 if layer is not None else 2 * layout.num_layers


_PUT_READY: contextvars.ContextVar[Any] = contextvars.ContextVar("tract_put_ready", default=None)


@contextlib.contextmanager
def put_ready(event: Any) -> Any:
    """CUDA puts started in this context (``Engine.put_kv`` with a CUDA tensor included) wait
    for ``event`` instead of an event recorded on the current stream at the call.

    Why: a prefill that hands layer ``i`` to the loop while its thread keeps queueing layers
    ``i + 1 ..`` on the same stream would otherwise make the DMA of layer ``i`` wait for all of
    them (the region-transfer stall: layer 2's DMA landed ~140 ms after it was enqueued, once
    the whole prefill had run). The caller must make sure the tensor is complete once ``event``
    has completed. A context variable, so that the setting follows the task across its awaits
    and reaches no other task."""
    token = _PUT_READY.set(event)
    try:
        yield
    finally:
        _PUT_READY.reset(token)


async def start_put(store: Any, cpath: CudaPath, keys: list[bytes], tensors: Sequence[Any],
                    make_plan: PlanFn, layer: int | None, timeout: float | None, *,
                    ready: Any = None, method: str | None = None) -> StreamFuture:
    """Reserve, enqueue, and return the transfer's future (its completion publishes).
    Raises what ``RegionStore.put`` raises before the copy (RegionFull, TransferTimeout)."""
    if len(keys) < PAUSE_MIN_BLOCKS:                 # (gc_paused leaves small ones alone)
        return await _start_put(store, cpath, keys, tensors, make_plan, layer, timeout,
                                 ready=ready, method=method)
    with gc_paused(len(keys)):
        return await _start_put(store, cpath, keys, tensors, make_plan, layer, timeout,
                                ready=ready, method=method)


class _EarlyPut:
    """A direct put's copies, started by the reservation between taking the slots and placing
    the index entries (``stores/txn.py``, ``EarlyCopies``; docs/design.md, "Copies before the
    entries"). Why: a whole prompt's DMA (426 MiB, ~8.4 ms) started only after the whole
    reservation -- the slots, then 213 entries written and their batch recorded -- and the
    put's ~1 ms over the raw copy was mostly that wait. The entries need not precede the
    copies: no reader finds a block before its entry is READY, and the slots are this node's
    from the moment they are taken. ``start`` builds the template from the offsets and
    enqueues the copies (nothing when the blocks need the gather path, or when an enqueue
    fails: the put stream is then drained and the put copies again after the placement, which
    raises the same error there); ``void`` waits for their event."""

    __slots__ = ("copier", "layout", "tensor", "layer", "ready", "started", "ev", "keep",
                 "tmpl", "dc")

    def __init__(self, copier: Copier, layout: Any, tensor: Any, layer: int | None,
                 ready: Any) -> None:
        self.copier = copier
        self.layout = layout
        self.tensor = tensor
        self.layer = layer
        self.ready = ready
        self.started = False
        self.ev: Any = None
        self.keep: tuple[Any, ...] = ()
        self.tmpl: Any = None
        self.dc: Any = None

    def start(self, offsets: np.ndarray) -> None:
        try:
            tmpl = self.copier.direct_template(self.layout, offsets, self.layer is None)
            if tmpl is None:
                return
            dc = tmpl.at(self.layer, self.tensor.data_ptr())
            self.ev, self.keep = self.copier.put_direct(dc, self.tensor, self.ready)
        except Exception:
            self.copier.put_dma.synchronize()       # what was enqueued has landed
            return
        self.tmpl, self.dc, self.started = tmpl, dc, True

    def void(self) -> None:
        if self.started:
            self.ev.synchronize()
            self.started, self.ev, self.keep = False, None, ()

    def holds(self, poffs: np.ndarray) -> bool:
        """The copies went where the reservation put the blocks (``poffs``, in key order): the
        template's offsets (``direct.Template.poffs``) are those."""
        if not self.started:
            return False
        p = self.tmpl.poffs
        return p is poffs or np.array_equal(p, poffs)


async def _start_put(store: Any, cpath: CudaPath, keys: list[bytes], tensors: Sequence[Any],
                     make_plan: PlanFn, layer: int | None, timeout: float | None, *,
                     ready: Any = None, method: str | None = None) -> StreamFuture:
    b, ph = store.blocks, store.phases
    t0 = time.perf_counter_ns() if ph is not None else 0
    if ready is None:
        ready = _PUT_READY.get()
    # a later layer of blocks this node is filling needs neither the key words, nor the index,
    # nor the lock (the request's blocks were reserved once, by its first layer's put)
    txn = PutTxn(b, keys, layer, timeout, "cuda")
    copier = cpath.copier(tensors[0].device)
    early = None
    if not txn.resume():
        direct_ok = (cpath.registered and type(make_plan) is ContiguousPlan
                     and copier.wants_direct(method))
        if direct_ok and cpath.early and len(keys) > SMALL_READ:
            early = txn.early = _EarlyPut(copier, store.layout, tensors[0], layer, ready)
        try:
            if not await txn.begin():
                return cpath.track(StreamFuture(DONE, completion=lambda: 0, label="put"))
        except BaseException:
            if early is not None:
                early.void()        # the reservation failed after the copies started
            raise
    res = txn.res
    if ph is not None:
        ph.add("reserve_incl_lock", t0)
        t0 = time.perf_counter_ns()
    poffs = txn.offsets()
    try:
        dc = tmpl = None
        if early is not None and txn.whole() and early.holds(poffs):
            dc, tmpl = early.dc, early.tmpl         # enqueued already: the future is all
        else:
            if early is not None:
                early.void()
                early = None
            b.alloc.check_not_fenced()      # stores/region.py, "Fenced copies"
            if (cpath.registered and type(make_plan) is ContiguousPlan and txn.whole()
                    and copier.wants_direct(method)):
                tmpl = copier.direct_template(store.layout, poffs, layer is None)
                if tmpl is not None:
                    dc = tmpl.at(layer, tensors[0].data_ptr())
        if dc is not None:
            nbytes = dc.nbytes
            if early is not None:
                ev, keep = early.ev, early.keep
                cpath.early_puts += 1
            else:
                ev, keep = copier.put_direct(dc, tensors[0], ready)
            m = "direct"
            if layer is not None and method is None and type(res) is FillBatch and res.whole:
                # the request's later layers: one short enqueue each (cuda/layerstream.py)
                cpath.streams.add_put(layerstream.PutStream(
                    keys, tensors[0], copier, tmpl, store.layout.num_layers, res))
        else:
            plan = make_plan(poffs, txn.positions())
            nbytes = plan.nbytes
            if not cpath.registered:
                return await _put_pinned(store, cpath, copier, txn, tensors, plan, ready)
            ev, keep, m = copier.put(plan, tensors, planes=planes_of(store.layout, layer),
                                     ready=ready, method=method)
        fut = _put_future(txn, ev, keep, nbytes, f"put/{m}", type(res) is FillBatch,
                          b.spin_ns)
        if ph is not None:
            ph.add("enqueue", t0)
        return cpath.track(fut)
    except BaseException:
        if early is not None:
            early.void()            # abandon only once no copy can still land
        await txn.abandon()
        raise


def _put_future(txn: PutTxn, ev: Any, keep: tuple[Any, ...], nbytes: int, label: str,
                early: bool, spin_ns: int) -> StreamFuture:
    """The future of a put's enqueued copies: its completion publishes once the DMA has landed
    (on the loop: the lifecycle's step 3, or only its bookkeeping when the poller's early step
    -- ``early``: a whole batch's -- stored the layer bits first)."""
    fut: StreamFuture | None = None

    def publish() -> int:
        return txn.publish(nbytes, region_done=fut is not None and fut.early_done)

    fut = StreamFuture(ev, completion=publish, keep=keep, nbytes=nbytes,
                       not_before_s=nbytes / LINK_BYTES_PER_S, label=label,
                       early=txn.publish_early if early else None, spin_ns=spin_ns)
    return fut


async def put_layer(store: Any, cpath: CudaPath, s: layerstream.PutStream, layer: int,
                    kv: Any, ready: Any, timeout: float | None) -> StreamFuture | None:
    """A later layer's put by stream ``s`` (``cuda/layerstream.py``); None: the stream does not
    apply (the caller takes the whole path). The steps of ``_start_put``'s direct branch, its
    abandon on a failed enqueue included."""
    streams = cpath.streams
    if not s.fits(layer, kv):
        streams.declined += 1
        return None
    b = store.blocks
    txn = PutTxn(b, s.keys, layer, timeout, "cuda")
    if not txn.resume() or txn.res is not s.batch or not s.batch.whole:
        # the reservations changed (split, published whole, abandoned): the whole path
        streams.drop(s)
        streams.declined += 1
        return None
    if ready is None:
        ready = _PUT_READY.get()
    try:
        b.alloc.check_not_fenced()
        dc = s.tmpl.at(layer, kv.data_ptr())
        ev, keep = s.copier.put_direct(dc, kv, ready)
        fut = _put_future(txn, ev, keep, s.nbytes, "put/direct", True, b.spin_ns)
    except BaseException:
        streams.drop(s)
        await txn.abandon()
        raise
    streams.used += 1
    return cpath.track(fut)


async def _put_pinned(store: Any, cpath: CudaPath, copier: Copier, txn: PutTxn,
                      tensors: Sequence[Any], plan: tables.RowPlan, ready: Any) -> StreamFuture:
    """The unregistered fallback: device -> pinned buffer -> CPU copy into the region, then
    publish (on the loop, in order)."""
    nbytes = plan.nbytes
    ev, keep, pinned = copier.d2h_pinned(plan, tensors, planes=planes_of(store.layout, txn.layer),
                                         ready=ready)
    landed = cpath.track(StreamFuture(ev, keep=keep, nbytes=nbytes, label="put/pinned"))
    await landed.wait_landed()
    rows = np.stack([plan.region_off, np.arange(len(plan), dtype=np.int64) * plan.row_bytes,
                     np.full(len(plan), plan.row_bytes, dtype=np.int64)], axis=1)
    await store.copy_in(rows, pinned.data_ptr(), nbytes)
    value = txn.publish(nbytes)
    return cpath.track(StreamFuture(DONE, completion=lambda: value, label="put/pinned"))


async def finish_put(store: Any, cpath: CudaPath, keys: list[bytes], fut: StreamFuture) -> int:
    """Await a put's future; on cancellation, stop its publication, wait for the DMA, evict."""
    try:
        ph = store.phases
        if ph is None:
            return await fut
        t0 = time.perf_counter_ns()
        n = await fut
        ph.add("landed_and_published", t0)
        return n
    except asyncio.CancelledError:
        if fut.cancel():
            cpath.cancelled += 1
            await asyncio.shield(_abandon_after_landing(store, keys, fut))
        raise
    except BaseException:
        await fut.wait_landed()
        await store.blocks.abandon(keys)
        raise


async def _abandon_after_landing(store: Any, keys: list[bytes], fut: StreamFuture) -> None:
    await fut.wait_landed()
    await store.blocks.abandon(keys)


# ---------------------------------------------------------------------------------------------
# get

async def start_get(store: Any, cpath: CudaPath, keys: list[bytes], tensors: Sequence[Any],
                    make_plan: PlanFn, layer: int | None, timeout: float | None, *,
                    result: Any, after: Any = None, method: str | None = None) -> StreamFuture:
    """Wait for the blocks, enqueue, and return the future (its completion validates and gives
    ``result``). Raises BlockNotFound, LayerNotReady, TransferTimeout, BlockEvicted (bounds)."""
    if len(keys) < PAUSE_MIN_BLOCKS:
        return await _start_get(store, cpath, keys, tensors, make_plan, layer, timeout,
                                result=result, after=after, method=method)
    with gc_paused(len(keys)):
        return await _start_get(store, cpath, keys, tensors, make_plan, layer, timeout,
                                result=result, after=after, method=method)


async def _start_get(store: Any, cpath: CudaPath, keys: list[bytes], tensors: Sequence[Any],
                     make_plan: PlanFn, layer: int | None, timeout: float | None, *,
                     result: Any, after: Any = None, method: str | None = None) -> StreamFuture:
    n = len(keys)
    b = store.blocks
    txn = ReadTxn(b, keys, layer, timeout, "cuda")
    snap = await txn.prepare()
    poffs = snap[:, SNAP_POFF].copy()
    lay = store.layout
    copier = cpath.copier(tensors[0].device)
    if cpath.registered:
        await invalidate_for_dma(b, poffs, layer)
    dc = tmpl = None
    if cpath.registered and type(make_plan) is ContiguousPlan and copier.wants_direct(method):
        tmpl = copier.direct_template(lay, poffs, layer is None)
        if tmpl is not None:
            dc = tmpl.at(layer, tensors[0].data_ptr())

    if dc is not None:
        nbytes = dc.nbytes
        ev, keep = copier.get_direct(dc, tensors[0], after)
        validate = _validator(cpath, txn, nbytes, result, cpu=False)
        if layer is not None and method is None:
            # the request's later layers: one short enqueue each (cuda/layerstream.py)
            gs = layerstream.GetStream(keys, tensors[0], copier, tmpl, lay.num_layers, poffs,
                                       snap.copy(), txn.key_words(), layer)
            cpath.streams.add_get(gs)
            validate = _validator(cpath, txn, nbytes, result, cpu=False,
                                  on_ok=_learn(gs, gs.rows, txn))
        fut = StreamFuture(ev, completion=validate, keep=keep, nbytes=nbytes,
                           not_before_s=nbytes / LINK_BYTES_PER_S, label="get/direct",
                           spin_ns=b.spin_ns)
    else:
        plan = make_plan(poffs, np.arange(n, dtype=np.int64))
        nbytes = plan.nbytes
        planes = planes_of(lay, layer)
        validate = _validator(cpath, txn, nbytes, result, cpu=not cpath.registered)
        if cpath.registered:
            ev, keep, m = copier.get(plan, tensors, planes=planes, after=after, method=method)
            fut = StreamFuture(ev, completion=validate, keep=keep, nbytes=nbytes,
                               not_before_s=nbytes / LINK_BYTES_PER_S, label=f"get/{m}",
                               spin_ns=b.spin_ns)
        else:
            import torch
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            rows = np.stack([plan.region_off, np.arange(len(plan), dtype=np.int64) * plan.row_bytes,
                             np.full(len(plan), plan.row_bytes, dtype=np.int64)], axis=1)
            await store.copy_out(rows, pinned.data_ptr(), nbytes)
            ev, keep = copier.h2d_pinned(plan, tensors, pinned, planes=planes)
            fut = StreamFuture(ev, completion=validate, keep=keep, nbytes=nbytes,
                               label="get/pinned")
    fut.transfer_mode_info = txn
    return cpath.track(fut)


def _validator(cpath: CudaPath, txn: ReadTxn, nbytes: int, result: Any, *, cpu: bool,
               on_miss: Callable[[], Any] | None = None,
               on_ok: Callable[[], Any] | None = None) -> Callable[[], Any]:
    """A read's completion: once its copy has landed, the lifecycle's step 4 (every block still
    the one snapshotted, else BlockEvicted, counted here, ``on_miss`` run; ``on_ok`` run when
    it passed); gives ``result``. ``cpu``: this host's CPU read the bytes (the pinned
    fallback)."""
    def validate() -> Any:
        try:
            txn.validate(nbytes, cpu=cpu)
        except BlockEvicted:
            cpath.validation_failures += 1
            if on_miss is not None:
                on_miss()
            raise
        if on_ok is not None:
            on_ok()
        return result
    return validate


def _learn(s: layerstream.GetStream, base: np.ndarray, txn: ReadTxn) -> Callable[[], None]:
    """A stream read's ``on_ok``: the layers its snapshot showed in become known to ``s``
    (``GetStream.validated``; cuda/layerstream.py, "Seen layers")."""
    return lambda: s.validated(base, txn.snap)


async def get_layer(store: Any, cpath: CudaPath, s: layerstream.GetStream, layer: int,
                    out: Any, after: Any, timeout: float | None,
                    result: Any) -> StreamFuture | None:
    """A later layer's get by stream ``s`` into ``out``; None: the stream does not apply. The
    steps of ``_start_get``'s direct branch (``prepare`` may wait for the layer, up to
    ``timeout``)."""
    streams = cpath.streams
    if not s.fits(layer, out):
        streams.declined += 1
        return None
    b = store.blocks
    txn = ReadTxn(b, s.keys, layer, timeout, "cuda", words=s.words)
    sp = s.poffs
    seen = s.knows(layer)
    if seen:                                # a validated read saw it in for every block
        txn.prepare_seen(s.rows)
    elif not txn.prepare_known(s.rows):
        snap = await txn.prepare()          # waits for the layer (or says what is wrong)
        poffs = snap[:, SNAP_POFF]
        if poffs.shape[0] != sp.shape[0] or not (poffs == sp).all():
            # the blocks moved (re-put elsewhere): this snapshot is good, the template is not
            streams.drop(s)
            streams.declined += 1
            return None
        s.new_rows(snap.copy())             # the same slots, maybe newer entries: kept fresh
    base = s.rows
    need = needing_invalidation(b, sp, layer)
    if need.size:                       # (no coroutine for the usual nothing-to-drop)
        await _invalidate(b, need, layer)
    dc = s.tmpl.at(layer, out.data_ptr())
    ev, keep = s.copier.get_direct(dc, out, after)
    nbytes = s.nbytes
    # a miss: the stream's rows are stale, so the next layer looks the keys up
    # a read that looked at no entry has nothing new to teach the stream
    validate = _validator(cpath, txn, nbytes, result, cpu=False, on_miss=lambda: streams.drop(s),
                          on_ok=None if seen else _learn(s, base, txn))
    fut = StreamFuture(ev, completion=validate, keep=keep, nbytes=nbytes,
                       not_before_s=nbytes / LINK_BYTES_PER_S, label="get/direct",
                       spin_ns=b.spin_ns)
    fut.transfer_mode_info = txn
    streams.used += 1
    return cpath.track(fut)


async def invalidate_for_dma(b: Any, poffs: np.ndarray, layer: int | None) -> int:
    """Before a device reads blocks ``poffs`` (``layer``, or all) by DMA: drop this host's
    cached lines of exactly the blocks its CPUs may have cached (``region/cpumarks.py``; a DMA
    is snooped against this host's caches, so no other line can be stale). Their marks are
    cleared first, then the lines dropped (the order a racing CPU read needs). Returns how many
    blocks were invalidated (usually none: a GPU-only node never reads payload with its CPU)."""
    need = needing_invalidation(b, poffs, layer)
    if need.size:
        await _invalidate(b, need, layer)
    return int(need.size)


def _range(b: Any, layer: int | None) -> tuple[int, int]:
    """(offset in a block, bytes) of ``layer``'s part (None: the whole block)."""
    lay = b.layout
    return (0, lay.block_bytes) if layer is None else (layer * lay.layer_bytes, lay.layer_bytes)


def needing_invalidation(b: Any, poffs: np.ndarray, layer: int | None) -> np.ndarray:
    """``invalidate_for_dma``'s look: the blocks among ``poffs`` this host's CPUs may have
    cached (``layer``'s part)."""
    rel, span = _range(b, layer)
    return b.cpu_marks.needing(poffs, rel, span)


async def _invalidate(b: Any, need: np.ndarray, layer: int | None) -> None:
    """``invalidate_for_dma``'s drop of the blocks ``need`` (marks cleared first)."""
    rel, span = _range(b, layer)
    b.cpu_marks.clear(need, rel, span)
    await drop_cached_payloads(b.mem, need, rel, span)


_inval_pool: Any = None


def _invalidate_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 1) // 2))


async def drop_cached_payloads(m: Any, poffs: np.ndarray, rel: int, span: int) -> None:
    """Drop this host's cached copies of the payload lines before a DMA reads them.

    One clflushopt per 64-byte line: 16.7 M lines for a 1 GiB get, ~20 ms on one core, as long
    as the DMA itself. Large gets split the blocks over up to 8 threads (half the cores; the
    kernel is nogil) and await them off the event loop. The sim backend keeps one thread: its
    private cache model is per thread and not thread-safe."""
    nbytes = int(poffs.shape[0]) * span
    threads = _invalidate_threads()
    if nbytes < R.PARALLEL_INVALIDATE_BYTES or threads == 1 or m[K.MEM_BACKEND] != K.BACKEND_HW:
        ix.invalidate_payloads(m, poffs, rel, span)
        return
    global _inval_pool
    if _inval_pool is None:
        from concurrent.futures import ThreadPoolExecutor
        _inval_pool = ThreadPoolExecutor(threads, thread_name_prefix="tract-invalidate")
    loop = asyncio.get_running_loop()
    parts = [p for p in np.array_split(poffs, threads) if p.size]
    futs = [loop.run_in_executor(_inval_pool, ix.invalidate_payloads, m, p, rel, span)
            for p in parts]
    done = asyncio.gather(*futs)
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        # nobody may unmap the region under a running invalidation: wait, then re-raise
        await asyncio.wait([done])
        raise


async def finish_get(store: Any, cpath: CudaPath, keys: list[bytes], fut: StreamFuture,
                     layer: int | None) -> Any:
    """Await a get's future; on cancellation return only once no more bytes can land."""
    try:
        out = await fut
    except asyncio.CancelledError:
        if fut.cancel():
            cpath.cancelled += 1
        await asyncio.shield(fut.wait_landed())
        raise
    txn: ReadTxn = fut.transfer_mode_info
    await txn.consume()
    return out

