"""The Engine: the public async API of tract_async.

    async with tract.Engine.open(cfg) as eng:
        keys = eng.block_keys(token_ids)
        hit = eng.lookup(keys)
        await eng.put_kv(keys, kv)                 # or layer by layer: put_kv(keys, kv[i], layer=i)
        kv2 = await eng.get_kv(keys, timeout=1.0)  # or get_kv(keys, layer=i, out=buf)

An Engine is one node of the rack. Opening it maps (or creates) the region, joins the node table,
and starts its background tasks in one TaskGroup: the heartbeat, the lock-manager candidate
(which manages the global lock while this is the lowest live node), and maintenance (LRU touches,
returned slots, transfer-only deadlines). Closing stops them, evicts this node's unfinished work,
gives its chunks back and leaves the node table, in reverse order of opening, keeping every error.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import dataclasses
import time
from collections import Counter
from typing import Any, Sequence

import numpy as np

from . import arrays
from .stores import plan as kvplan
from .config import EngineConfig, KVLayout
from .cuda.api import CudaOps  # the CUDA methods live in tract_async.cuda (composition)
from .errors import (EngineClosed, NodeEvicted, RegionError, RegionExists, RegionInitializing,
                     RegionInUse, RegionTooSmall, TensorMismatch, TractError)
from .keys import BlockKey, KeyScheme, Namespace
from .sync.settle import settled


def _device_type(device: Any) -> str:
    """"cpu" / "cuda" / ... of a device string or torch.device (no torch needed for a string)."""
    if isinstance(device, str):
        return device.split(":", 1)[0]
    return str(getattr(device, "type", device))


def _cuda_method(name: str) -> Any:
    """An Engine method that delegates to ``CudaOps.<name>``, with its signature and docstring
    (``inspect.signature`` and ``help`` show the real ones through ``__wrapped__``)."""
    impl = getattr(CudaOps, name)
    if asyncio.iscoroutinefunction(impl):
        async def method(self: "Engine", *args: Any, **kwargs: Any) -> Any:
            return await getattr(self._cuda_ops, name)(*args, **kwargs)
    else:
        def method(self: "Engine", *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            return getattr(self._cuda_ops, name)(*args, **kwargs)
    return functools.wraps(impl)(method)


class _Parts:
    """The ``EngineParts`` view (cuda/api.py) of one Engine (``Engine.parts``): its composed
    CUDA half and the package's own tools (warm-up, soak) read the engine through these
    names, never through the Engine's private fields, and the engine keeps one place (here)
    that says what it shares. Not a user API: what it names may change with the stores."""

    __slots__ = ("_eng",)

    def __init__(self, eng: "Engine") -> None:
        self._eng = eng

    @property
    def layout(self) -> KVLayout:
        return self._eng.layout

    @property
    def store(self) -> Any:
        return self._eng._store

    @property
    def xfer(self) -> Any:
        return self._eng._xfer

    @property
    def region(self) -> Any:
        return self._eng._region

    def check_open(self) -> None:
        self._eng._check_open()

    def lock_timeout(self, timeout: float | None) -> float:
        return self._eng._lock_timeout(timeout)

    def spawn(self, coro: Any, name: str) -> "asyncio.Task[Any]":
        tg = self._eng._tg
        if tg is None:
            coro.close()
            raise EngineClosed("the engine is not running: open it first")
        return tg.create_task(coro, name=name)


class Engine:
    """One node's handle on the rack: see the module docstring. Build with ``Engine.open``."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        ns = Namespace(model=cfg.namespace, num_layers=cfg.layout.num_layers,
                       block_tokens=cfg.layout.block_tokens, kv_heads=cfg.layout.kv_heads,
                       head_dim=cfg.layout.head_dim, dtype=cfg.layout.dtype_name, rank=cfg.rank,
                       world_size=cfg.world_size)
        self.keys = KeyScheme(seed=cfg.seed, namespace=None if cfg.vllm_compatible_keys else ns,
                              vllm_compatible=cfg.vllm_compatible_keys)
        self._store: Any = None
        self._http: Any = None      # HttpStore: the HTTP transport, or the region's fallback
        self._xfer: Any = None      # what put/get/lookup use: RegionStore, HttpStore, FallbackStore
        self._small: Any = None     # SmallPath (stores/small.py) when the region is the only store
        self.fallbacks: Counter[str] = Counter()   # transfers (or opens) that fell back, by reason
        self.fallback_reason: str | None = None    # why the region could not be attached
        self._region: Any = None
        self._created = False       # this engine created the region (remove_on_close applies)
        self._handle: Any = None
        self._lock: Any = None
        self._layouts: Any = None   # LayoutGuard: this namespace's record in the region
        self._manager: Any = None
        self._manager_thread: Any = None
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: list[asyncio.Task[Any]] = []    # the TaskGroup's tasks, cancelled at close
        self._failed = asyncio.Event()                # set (thread-safely) with ``_failure``
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = True
        self._failure: BaseException | None = None
        self._opened_at = 0.0
        self._hb_thread: threading.Thread | None = None
        self._hb_stop_word = np.zeros(1, dtype=np.uint64)   # non-zero: the heartbeat stops
        self.parts = _Parts(self)     # the typed view the CUDA half and the package's tools use
        self._cuda_ops = CudaOps(self.parts)                # CUDA tensors, paged pools, NVML
        # the per-layer entry points, bound straight to the CUDA half: the class's delegating
        # coroutine (``_cuda_method``, kept for ``help`` and the signature) was one more frame
        # and coroutine on every layer operation (~2 µs of a one-block layer's host time)
        self.start_put_kv = self._cuda_ops.start_put_kv  # type: ignore[method-assign]
        self.start_get_kv = self._cuda_ops.start_get_kv  # type: ignore[method-assign]
        self._cpu_qos: Any = None     # CpuLatencyRequest while open (cfg.cpu_wake_latency_us)

    # the CUDA API (tract_async/cuda/api.py: signatures and docstrings there)
    cuda_setup = _cuda_method("cuda_setup")
    start_put_kv = _cuda_method("start_put_kv")
    start_get_kv = _cuda_method("start_get_kv")
    start_put_kv_paged = _cuda_method("start_put_kv_paged")
    put_kv_paged = _cuda_method("put_kv_paged")
    start_get_kv_paged = _cuda_method("start_get_kv_paged")
    get_kv_paged = _cuda_method("get_kv_paged")
    start_telemetry = _cuda_method("start_telemetry")
    stop_telemetry = _cuda_method("stop_telemetry")

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def open(cls, cfg: EngineConfig) -> "_EngineContext":
        """``async with Engine.open(cfg) as eng:`` (or ``eng = await Engine.open(cfg)``, then
        ``await eng.close()``)."""
        return _EngineContext(cls(cfg))

    def _http_configured(self) -> bool:
        c = self.cfg
        return bool(c.peers) or c.secret is not None or c.allow_unauthenticated

    async def _start(self) -> None:
        """region=None: HTTP transport. A region: the region, plus (fallback=True and HTTP
        configured: peers, or a secret to serve them) an HttpStore per transfer; a region that
        cannot be attached then runs the whole engine on HTTP (``fallbacks['attach']``)."""
        await self._start_stores()
        # the one-block fast path, with the region as the only store (stores/small.py)
        self._small = getattr(self._xfer, "small", None)

    async def _start_stores(self) -> None:
        cfg = self.cfg
        if cfg.cpu_wake_latency_us is not None and self._cpu_qos is None:
            from .host.cpu_qos import CpuLatencyRequest
            self._cpu_qos = CpuLatencyRequest(cfg.cpu_wake_latency_us)
            self._cpu_qos.acquire()         # a warning where not permitted, never an error
        if cfg.region is None:
            return await self._start_http(region_uuid=None)
        want_http = cfg.fallback and self._http_configured()
        try:
            await self._start_region()
        except RegionError as e:
            if not want_http or isinstance(e, (RegionExists, RegionTooSmall)):
                raise
            self.fallbacks["attach"] += 1
            self.fallback_reason = f"{type(e).__name__}: {e}"
            return await self._start_http(region_uuid=None)
        if want_http:
            from .stores.fallback import FallbackStore
            from .stores.network import network_store
            try:
                self._http = network_store(cfg, region_uuid=str(self._region.uuid))
                await self._http.open()
                self._xfer = FallbackStore(self._store, self._http, self.fallbacks)
            except BaseException:
                await self._teardown(graceful=False)
                raise

    async def _start_http(self, *, region_uuid: str | None) -> None:
        from .stores.network import network_store
        try:
            self._http = network_store(self.cfg, region_uuid=region_uuid)
            await self._http.open()
            self._store = self._xfer = self._http
            await self._enter_task_group()
            self._spawn(self._maintenance(), f"tract-maintenance-{self.cfg.node_id}")
        except BaseException:
            await self._teardown(graceful=False)
            raise
        self._closed = False
        self._opened_at = time.monotonic()

    async def _start_region(self) -> None:
        cfg = self.cfg
        from .engine_layout import (check_create_size, check_holds_block, initialize,
                                    region_sections)
        from .region import Region
        from .region.alloc import Allocator
        from .region.index import PrefixIndex
        from .stores.layouts import LayoutGuard
        from .stores.region import RegionStore
        from .sync.lock import GlobalLock
        from .sync.manager import LockManager, ManagerPolicy
        from .sync.manager_thread import ManagerThread
        from .kernel_cache import ensure_warm
        # every kernel compiled (a cold cache: the warm-up scenario, tens of seconds) and loaded
        # before this node joins: a compile holds the GIL and Numba's compiler lock, which
        # starved the lock manager's thread into stepping down when it came after the join
        # (issue 36; kernel_cache.py)
        await ensure_warm(cfg.mem_backend)
        sim_seed = cfg.sim_seed if cfg.sim_seed is not None else 1000 + cfg.node_id
        opened: list[Any] = []
        try:
            if cfg.create:
                check_create_size(path=cfg.region, region_bytes=cfg.region_bytes,
                                  max_nodes=cfg.max_nodes, chunk_bytes=cfg.chunk_bytes,
                                  block_bytes=cfg.layout.block_bytes,
                                  index_capacity=cfg.index_capacity)
                secs = region_sections(size_bytes=cfg.region_bytes, max_nodes=cfg.max_nodes,
                                       chunk_bytes=cfg.chunk_bytes,
                                       block_bytes=cfg.layout.block_bytes,
                                       index_capacity=cfg.index_capacity)
                try:
                    self._region = Region.create(cfg.region, cfg.region_bytes,
                                                 max_nodes=cfg.max_nodes, sections=secs,
                                                 backend=cfg.mem_backend, sim_seed=sim_seed,
                                                 overwrite=cfg.overwrite, mode=cfg.region_mode,
                                                 initialize=initialize)
                except RegionExists:
                    if cfg.overwrite:   # another process is creating one there right now
                        raise
                    raise RegionExists(
                        f"{cfg.region}: a region (or another file) is already there, e.g. left by "
                        f"an earlier run (a created region outlives its engine): attach to it "
                        f"with EngineConfig(create=False), replace it with EngineConfig("
                        f"create=True, overwrite=True), have the creator remove it on close with "
                        f"remove_on_close=True, or remove it with `tract region rm "
                        f"{cfg.region}`") from None
                self._created = True
            else:
                self._region = await self._attach_region(sim_seed)
            opened.append(self._region)
            check_holds_block(self._region, cfg.layout.block_bytes)
            # the layout is part of the region's contract: refused before joining when this
            # namespace is recorded with another one (stores/layouts.py)
            self._layouts = LayoutGuard(self._region, cfg)
            self._layouts.check_open()
            self._handle = self._region.nodes.join(cfg.node_id, timeout_s=cfg.liveness_timeout_s)
            # the holder lease: check_token refuses writes once this node's own heartbeat is
            # half the liveness timeout old (a revocation may be in flight; model finding A2)
            self._lock = GlobalLock(self._region, self._handle,
                                    liveness_timeout_s=cfg.liveness_timeout_s)
            # the manager's poll sleeps are capped at 100 us while it is busy (a grant then waits
            # ~0.1-0.2 ms instead of ~0.6 ms); 20 ms after its last event it sleeps on its bell
            # instead (sync/bell.py: a same-host requester rings it). The default 2 ms spin
            # after each request/release stays: 0.3 ms measured better for one process's large
            # puts on 2 cores (16 MiB 3.6 -> 4-4.9 GB/s) but cost another node's next request
            # the manager's sleep back-off (64 KiB handoff p50 206 -> 322 us)
            self._manager = LockManager(self._region, self._handle,
                                        liveness_timeout_s=cfg.liveness_timeout_s,
                                        policy=ManagerPolicy(sleep_us_max=100))
            index = PrefixIndex(self._region)
            # a dead node's chunks leave with their index entries (``drop_spans_locked``)
            alloc = Allocator(self._region, self._handle, liveness_timeout_s=cfg.liveness_timeout_s,
                              on_reclaim=lambda node, spans: self._on_reclaim(node, spans))
            self._store = self._xfer = RegionStore(cfg, self._region, self._lock, alloc, index,
                                                   cuda_path=self._cuda_ops.path)
            self._store.start_waking()
            await self._enter_task_group()
            self._hb_stop_word = np.zeros(1, dtype=np.uint64)
            self._hb_thread = threading.Thread(target=self._heartbeat_thread,
                                               name=f"tract-heartbeat-{cfg.node_id}", daemon=True)
            self._hb_thread.start()
            self._spawn(self._watch_failure(), f"tract-watch-{cfg.node_id}")
            # the manager grants for the whole rack: on its own thread and loop, so that user
            # code blocking this loop cannot stop other nodes' puts (sync/manager_thread.py)
            self._manager_thread = ManagerThread(self._manager)
            manager = self._manager
            self._store.blocks.reclaims_dead = lambda: manager.is_manager
            self._manager_thread.start()
            self._spawn(self._manager_thread.supervise(), f"tract-manager-{cfg.node_id}")
            self._spawn(self._maintenance(), f"tract-maintenance-{cfg.node_id}")
            if cfg.preclaim_bytes != 0:
                self._spawn(self._store.blocks.preclaimer.run(), f"tract-preclaim-{cfg.node_id}")
            await self._warm_up()
        except BaseException:
            await self._teardown(graceful=False)
            raise
        self._closed = False
        self._opened_at = time.monotonic()

    async def _attach_region(self, sim_seed: int) -> Any:
        """Attach to the region; while a live creator is still initializing it, wait (polling,
        without blocking the event loop) up to ``attach_timeout_s``. Raises what
        ``Region.attach`` raises; RegionInitializing names the config field."""
        from .region import Region
        cfg = self.cfg
        deadline = time.monotonic() + cfg.attach_timeout_s
        pause_s = 0.002
        while True:
            try:
                return Region.attach(cfg.region, backend=cfg.mem_backend, sim_seed=sim_seed,
                                     wait_init_s=0.0)
            except RegionInitializing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegionInitializing(
                        f"{cfg.region}: still initializing: its creator (a live process on this "
                        f"host) had not finished after {cfg.attach_timeout_s:g} s "
                        f"(EngineConfig.attach_timeout_s)") from None
            await asyncio.sleep(min(pause_s, left))
            pause_s = min(2 * pause_s, 0.05)

    async def _warm_up(self) -> None:
        """Return from open only once this node can take the global lock.

        With a cold Numba cache the first lock round trip compiles the waiter's and the
        manager's kernels (seconds); doing it here, with a generous deadline, keeps that out of
        the first put's lock timeout. With a warm cache it costs one round trip. Holding it,
        this engine's namespace is recorded (``stores/layouts.py``), before any put.
        Raises LayoutMismatch, NamespaceTableFull.
        """
        self._store.index.lookup(np.zeros((0, 4), dtype=np.uint64))
        await self._lock.acquire(timeout=max(60.0, 8 * self.cfg.liveness_timeout_s))
        try:
            self._layouts.record_locked()
        finally:
            self._lock.release()
        self._store.blocks.use_layouts(self._layouts)

    def _heartbeat_thread(self) -> None:
        """Beat from a thread, not a task, and from jitted code that holds no GIL
        (``NodeTable.beat_until_stopped``): neither a busy event loop (a loop of gets that
        never suspend) nor a Python-level stall (a long compile, a C call that keeps the GIL)
        may get a live node judged dead, revoked, and its chunks reclaimed under its feet."""
        try:
            self._region.nodes.beat_until_stopped(self._handle, self.cfg.heartbeat_interval_s,
                                                  self._hb_stop_word)
        except NodeEvicted as e:
            self._fail(e)
        except Exception as e:  # a closed region at shutdown: stop quietly
            if not self._hb_stop_word[0]:
                self._fail(e)

    def _on_reclaim(self, node_id: int, spans: list[tuple[int, int]]) -> None:
        if self._store is not None:
            self._store.on_reclaim(node_id, spans)

    async def _enter_task_group(self) -> None:
        """Open the TaskGroup that owns the background tasks for the engine's lifetime (it
        spans ``open`` to ``close``, so it is entered here and left in ``_teardown``)."""
        self._loop = asyncio.get_running_loop()
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()

    def _spawn(self, coro: Any, name: str) -> None:
        assert self._tg is not None, "engine: a background task started outside open()"
        self._tasks.append(self._tg.create_task(coro, name=name))

    def _fail(self, error: BaseException) -> None:
        """Record a failure seen on another thread and wake ``_watch_failure``."""
        self._failure = error
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._failed.set)
            except RuntimeError:     # the loop closed meanwhile
                pass

    async def _watch_failure(self) -> None:
        """Surface a heartbeat failure (this node was taken over) into the TaskGroup."""
        await self._failed.wait()
        assert self._failure is not None
        raise self._failure

    async def _maintenance(self) -> None:
        period = max(0.05, self.cfg.heartbeat_interval_s * 2)
        while True:
            await asyncio.sleep(period)
            try:
                await self._xfer.maintain(timeout=self.cfg.liveness_timeout_s * 4)
            except TractError:
                pass  # transient (lock timeout while the manager fails over): next round

    async def close(self) -> None:
        """Stop background tasks, evict unfinished puts and this node's blocks, return chunks,
        leave the node table, unmap, and with ``remove_on_close`` remove the region this engine
        created. Idempotent; raises the first error after finishing all (RegionInUse: other
        nodes were live, the region was left in place)."""
        if self._closed and self._tg is None and self._region is None and self._http is None:
            return
        self._closed = True
        await self._teardown(graceful=True)

    async def _teardown(self, *, graceful: bool) -> None:
        """Release everything, in order, whatever happens meanwhile.

        A background task that fails while this runs (the heartbeat finding the node taken
        over, the manager, maintenance) aborts the TaskGroup, which cancels the task that
        opened it: this one. A cancellation landing in one of the awaits below would skip the
        rest -- the TaskGroup, the lock, the mapping and the region file left behind (seen by
        injecting failures at random moments, session 45). So each step runs to its end
        through cancellations (``_through_cancel``), and a cancellation that still stands once
        the TaskGroup took back its own (``Task.cancelling``) is raised at the end."""
        errors: list[BaseException] = []
        cancelled = [False]
        qos, self._cpu_qos = self._cpu_qos, None
        if qos is not None:
            qos.release()
        try:  # CUDA hook: DMAs in flight land, then the mapping is unregistered (before unmap)
            await _through_cancel(self._cuda_ops.teardown(), cancelled)
        except Exception as e:
            errors.append(e)
        if self._http is not None:  # first: peers hear this node's blocks are gone
            http, self._http = self._http, None
            try:
                await _through_cancel(
                    http.close(timeout=max(2.0, 4 * self.cfg.liveness_timeout_s)), cancelled)
            except Exception as e:
                errors.append(e)
        if graceful and self._region is not None and self._failure is None:
            try:
                await _through_cancel(
                    self._store.close(timeout=max(2.0, 4 * self.cfg.liveness_timeout_s)),
                    cancelled)
            except Exception as e:  # keep going: the rest must still be released
                errors.append(e)
        if getattr(self, "_hb_thread", None) is not None:
            self._hb_stop_word[0] = 1
            await _through_cancel(asyncio.get_running_loop().run_in_executor(
                None, self._hb_thread.join, 5.0), cancelled)
            self._hb_thread = None
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tasks, self._tasks = self._tasks, []
            for t in tasks:
                t.cancel()
            try:
                await tg.__aexit__(None, None, None)
            except BaseExceptionGroup as eg:  # noqa: F821 (3.11 builtin)
                errors.extend(e for e in eg.exceptions if not isinstance(e, asyncio.CancelledError))
            except asyncio.CancelledError:
                cancelled[0] = True
        if self._lock is not None:
            with contextlib.suppress(Exception):
                self._lock.close()
            self._lock = None
        if self._region is not None:
            region, self._region = self._region, None
            try:
                if self._handle is not None:
                    region.nodes.leave(self._handle)
            except Exception as e:
                errors.append(e)
            self._manager = None
            if self._manager_thread is not None:      # stopped by its supervisor; belt and braces
                self._manager_thread.stop(timeout=5.0)
                self._manager_thread = None
            others: list[int] | None = []
            if self._created and self.cfg.remove_on_close:
                try:
                    others = region.nodes.live_ids(timeout_s=self.cfg.liveness_timeout_s)
                except Exception as e:   # unknown who is live: keep the region
                    errors.append(e)
                    others = None
            stop_copies = getattr(self._store, "shutdown_copies", None)
            if stop_copies is not None:     # a teardown without store.close: copy threads too
                stop_copies()
            stop_waking = getattr(self._store, "stop_waking", None)
            if stop_waking is not None:
                stop_waking()
            region.close()
            if self._created and self.cfg.remove_on_close and others is not None:
                self._created = False
                if others:
                    errors.append(RegionInUse(
                        f"{region.path}: not removed on close: nodes {others} are still live on "
                        f"it (close them first, or `tract region rm --force {region.path}`)"))
                else:
                    from .region import remove
                    try:
                        remove(region.path)
                    except Exception as e:
                        errors.append(e)
        self._store = self._xfer = None
        if errors:
            # the failure that stopped the engine first: a step it made fail (the store's close
            # without the lock manager, whose task the abort cancelled) is its consequence
            f = self._failure
            raise f if f is not None and any(e is f for e in errors) else errors[0]
        task = asyncio.current_task()
        if cancelled[0] and task is not None and task.cancelling():
            raise asyncio.CancelledError()

    def _lock_timeout(self, timeout: float | None) -> float:
        """``timeout``, or the default for calls that need the global lock: 4 liveness timeouts
        (a manager failover fits), at least 5 s."""
        return timeout if timeout is not None else max(5.0, 4 * self.cfg.liveness_timeout_s)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(cfg)")
        if self._failure is not None:
            raise EngineClosed(f"the engine stopped: {self._failure}") from self._failure

    # -- the API ------------------------------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int] | Any, *,
                   extra_keys: Sequence[Any] | None = None) -> list[BlockKey]:
        """One key per full block of ``token_ids`` (ints, a torch tensor or a numpy array),
        equal on every node (see ``keys``). A trailing partial block has no key, so a prompt
        shorter than ``layout.block_tokens`` has none: ``[]``, and nothing to put or get."""
        if arrays.is_array(token_ids):
            token_ids = token_ids.reshape(-1).tolist()
        return self.keys.chain(token_ids, self.layout.block_tokens, extra_keys=extra_keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks are resident and complete. Never blocks, takes no lock."""
        self._check_open()
        return self._xfer.lookup(kvplan.check_keys(keys))

    async def put_kv(self, keys: Sequence[bytes], kv: Any, *, layer: int | None = None,
                     timeout: float | None = None) -> int:
        """Store the KV of ``keys`` (blocks already present are skipped); returns blocks written.

        ``kv``: ``(num_layers, 2, n*block_tokens, kv_heads, head_dim)``, or with ``layer=i``
        ``(2, n*block_tokens, kv_heads, head_dim)``; dtype from the layout. A torch tensor (CPU or
        CUDA), or a numpy array of the layout's storage dtype (``tract_async.arrays``: the core
        runs without torch). The first put of a key
        reserves its block; later layers fill it; other nodes see each layer as it lands.
        Raises TensorMismatch, KeyMismatch, RegionFull, TransferTimeout (lock), EngineClosed.
        """
        self._check_open()
        if layer is None and self._small is not None:
            done = self._small.put(keys, kv)       # None: not the one-block case (small.py)
            if done is not None:
                return done
        ks = kvplan.check_keys(keys)
        kvplan.check_layer(layer, self.layout)
        # a network store whose pool is in GPU memory takes CUDA tensors as they are; otherwise
        # CUDA tensors take the CUDA hook (region DMA, or host staging on a network store)
        gpu_pool = self._region is None and getattr(self._xfer, "takes_cuda", False)
        if arrays.is_cuda(kv) and not gpu_pool:  # CUDA hook (cuda.api)
            return await self._cuda_ops.put_cuda(ks, kv, layer, timeout)
        kvplan.check_tensor(kv, self.layout, len(ks), layer, what="kv", allow_cuda=gpu_pool)
        if not ks:
            return 0
        return await self._xfer.put(ks, kv, layer, self._lock_timeout(timeout))

    async def get_kv(self, keys: Sequence[bytes], *, out: Any = None,
                     layer: int | None = None, timeout: float | None = None,
                     device: Any = None) -> Any:
        """Read the KV of ``keys`` into ``out`` (or a new tensor) and return it.

        A new array is a torch tensor where torch is installed, else a numpy array of the
        layout's storage dtype; ``out`` may be either (``tract_async.arrays``).

        With ``timeout`` it waits that long for blocks (or the layer) still being produced.
        Raises BlockNotFound, LayerNotReady (no timeout), TransferTimeout, BlockEvicted (the
        block changed during the read: a miss), LayoutMismatch (a block stored by a namespace
        of another layout: its key came from elsewhere), TensorMismatch, KeyMismatch,
        EngineClosed.
        """
        self._check_open()
        if (layer is None and out is not None and device is None and self._small is not None
                and self._small.get(keys, out)):
            return out                                  # the one-block fast path (small.py)
        ks = kvplan.check_keys(keys)
        kvplan.check_layer(layer, self.layout)
        gpu_pool = self._region is None and getattr(self._xfer, "takes_cuda", False)
        dev = None if device is None else _device_type(device)
        if not gpu_pool and (arrays.is_cuda(out) if out is not None else dev == "cuda"):
            return await self._cuda_ops.get_cuda(ks, out, layer, timeout, device)
        if dev is not None and dev not in (("cpu", "cuda") if gpu_pool else ("cpu",)):
            raise TensorMismatch(f"device={device}: this path returns CPU tensors")
        if out is None:
            out = arrays.empty(self.layout.kv_shape(len(ks), layer), self.layout.dtype_name,
                               device=device if gpu_pool and device is not None else None)
        else:
            kvplan.check_tensor(out, self.layout, len(ks), layer, what="out", allow_cuda=gpu_pool)
            if not arrays.is_contiguous(out):
                raise TensorMismatch("out must be contiguous")
        if not ks:
            return out
        return await self._xfer.get(ks, out, layer, timeout)

    def stats(self) -> dict[str, Any]:
        """Counters: hits, misses, bytes, evictions, lock waits, ... (a fresh dict)."""
        net = self._http.transport_name if self._http is not None else "http"
        transport = (f"region+{net}" if self._region is not None and self._http is not None
                     else net if self._http is not None else "region")
        out: dict[str, Any] = {"node_id": self.cfg.node_id, "transport": transport,
                               "open": not self._closed, "fallbacks": dict(self.fallbacks),
                               "uptime_s": time.monotonic() - self._opened_at if self._opened_at else 0.0}
        if self._http is not None:
            h = {**dataclasses.asdict(self._http.stats), **self._http.describe()}
            if self._region is None:
                out.update(h)
            else:
                out["http"] = h
        if self._store is not None and self._region is not None:
            out.update(dataclasses.asdict(self._store.stats))
            out["reserved_in_flight"] = self._store.blocks.in_flight
            out["index"] = self._store.index.counters()
            a = self._store.alloc.statistics()
            out["alloc"] = {"chunks": a.chunks, "slots_used": a.slots_used, "bytes_used": a.bytes_used}
        if self._lock is not None:
            s = self._lock.statistics()
            out["lock"] = dataclasses.asdict(s) if dataclasses.is_dataclass(s) else dict(s)
        if self._manager is not None:
            out["is_lock_manager"] = self._manager.is_manager
        out["cuda"] = self._cuda_ops.stats()  # None until a CUDA transfer or cuda_setup()
        return out

    async def recover(self, *, timeout: float | None = None) -> list[str]:
        """Run recovery now, as the next chunk claim would: finish a journal left pending and
        reclaim dead nodes' chunks, dropping their index entries. Returns what was done (empty
        when nothing was needed). Raises TransferTimeout (lock), EngineClosed."""
        self._check_open()
        if self._region is None:
            return []
        st = self._store.blocks
        await st.hold_lock(self._lock_timeout(timeout))
        try:
            return self._store.alloc.recover_locked(self._lock)
        finally:
            self._lock.release()

    def time_phases(self, on: bool = True) -> Any:
        """Measure where the region store's puts and gets spend their time (for benchmarks;
        ``stores/phases.py``): returns the PhaseTimes to ``take()`` from, or None when switched
        off or when this engine has no region store."""
        from .stores.phases import PhaseTimes
        st = self._store if self._region is not None else None
        if st is None:
            return None
        st.phases = PhaseTimes() if on else None
        st.blocks.doorbell.phases = st.phases       # its "woken" stamps
        return st.phases

    @property
    def url(self) -> str | None:
        """Where this engine's HTTP agent serves (peers list it in ``peers``); None without HTTP."""
        return None if self._http is None else self._http.url

    @property
    def region(self) -> Any:
        """The mapped Region (None for the HTTP transport or when closed)."""
        return self._region


async def _through_cancel(aw: Any, cancelled: list[bool]) -> Any:
    """Await ``aw`` to its end even if the awaiting task is cancelled meanwhile (the step runs
    as its own task: ``sync.settle.settled``); a cancellation of the caller sets
    ``cancelled[0]`` instead of stopping the wait (``Engine._teardown``). The step's own result
    or error is returned or raised; a step that was itself cancelled raises CancelledError."""
    fut = asyncio.ensure_future(aw)
    if await settled(fut):
        cancelled[0] = True
    return fut.result()


class _EngineContext:
    """What ``Engine.open`` returns: an async context manager, also awaitable."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __await__(self):  # noqa: ANN204
        return self._open().__await__()

    async def _open(self) -> Engine:
        await self._engine._start()
        return self._engine

    async def __aenter__(self) -> Engine:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        await self._engine.close()


def run(coro: Any) -> Any:
    """Run a coroutine on uvloop (the default runner), or asyncio where uvloop is missing."""
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


__all__ = ["Engine", "run"]

