"""``TractConnector``: tract_async as a KV connector of vLLM's v1 API (``KVConnectorBase_V1``).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TractConnector",
        "kv_connector_module_path": "tract_async.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"region": "/dev/shm/tract-vllm", "node_id": 0}}'

vLLM builds two instances: one in the scheduler process (``KVConnectorRole.SCHEDULER``) and
one in each worker (``WORKER``). Each opens its own ``Engine`` (its own node of the region) on
its own ``LoopThread`` (``bridge.py``: vLLM's threads never run a coroutine themselves).

Scheduler side. ``get_num_new_matched_tokens`` computes the request's block keys (the engine's
chained keys over the prompt, vLLM's block size, the model and KV layout in the namespace) and
asks the region's index how many leading blocks are resident (``Engine.lookup``: a lock-free
read of shared memory, so it is called on the scheduler's thread without a hop to the loop).
It leaves at least one prompt token to compute (vLLM needs a token to sample from) and returns
``load_kv_async=False``: the load runs layer by layer inside the step's forward pass.
``update_state_after_alloc`` turns the hit into (keys, vLLM block ids) to load;
``build_connector_meta`` adds, for every scheduled request, the prompt blocks that this step
completes and that the region does not hold yet (to save); ``request_finished`` frees the
blocks at once (``wait_for_save`` finished this step's saves before the step returned) and,
on a producer, hands the decode side ``kv_transfer_params`` naming the region.

Worker side. ``register_kv_caches`` checks vLLM's ``[B, H, N, C]`` views against the layout
(``pages.py``). ``start_load_kv`` submits one coroutine for the step that reads layer 0 of
every loading request, then layer 1, ...; each layer's completion is a
``concurrent.futures.Future`` that ``wait_for_layer_load`` blocks on, so attention layer ``i``
waits for layer ``i`` only, while later layers are still being read. ``save_kv_layer`` submits
the layer's put and returns; ``wait_for_save`` waits for the step's puts. A load that fails
(block evicted or gone with its producer, a layer that never came, a timeout) is logged and
its request's blocks are returned by ``get_block_ids_with_load_errors``: vLLM then recomputes
them (``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``, vLLM's
default). A block is written into vLLM's pages only after the engine validated its read, so
a failed load never serves bytes that were not the block's.

Roles: ``kv_producer`` saves and never loads, ``kv_consumer`` loads and never saves,
``kv_both`` does both (the prefix cache, shared by every instance on the region).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from .requirement import require_vllm

require_vllm()   # MissingExtra naming the extra, before vLLM's own imports fail bare

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheConfig

from ...config import EngineConfig, KVLayout
from ...engine import Engine
from ...errors import TractError
from .bridge import LoopThread
from .pages import check_page_view, gather_layer, scatter_layer
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger("tract_async.integrations.vllm")

OPEN_TIMEOUT_S = 300.0
"""Opening an engine may compile the Numba kernels on a cold cache (tens of seconds)."""


@dataclasses.dataclass
class BlockTransfer:
    """One request's blocks to move this step: ``keys[i]`` is in vLLM's pool block
    ``block_ids[i]``. Plain bytes and ints: vLLM serializes the metadata to its workers."""
    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclasses.dataclass
class TractConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: what to load before the forward pass uses it and
    what to save as it is computed."""
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _RequestState:
    """The scheduler's record of one request it has seen (dropped in ``request_finished``)."""
    keys: list[bytes] | None          # None: not cacheable (multimodal or embeddings input)
    num_prompt_tokens: int
    block_ids: list[int] = dataclasses.field(default_factory=list)
    saved: int = 0                    # leading blocks the region holds or this request saved
    hit_blocks: int = 0               # the last lookup's (capped) hit
    local_tokens: int = 0             # num_computed_tokens of the last matched-tokens call
    remote_deadline: float | None = None


def layout_from_kv_cache_config(kv_cache_config: KVCacheConfig) -> tuple[KVLayout, list[str]]:
    """The engine layout and the ordered attention layer names (index = the engine's layer).

    One cache group of full attention with K and V of equal size is supported: the engine's
    layout is one geometry for every layer. Anything else (MLA, sliding window or hybrid
    groups, packed or quantized pages) raises ValueError at start-up, not mid-serving."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"the tract connector supports one KV cache group, got {len(groups)} "
                         f"(hybrid models are not supported)")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or not isinstance(spec, AttentionSpec):
        raise ValueError(f"the tract connector supports full attention (FullAttentionSpec), "
                         f"got {type(spec).__name__}")
    if (spec.head_size_v != spec.head_size or spec.state_content_bytes is not None
            or spec.num_head_slots is not None or spec.page_size_padded is not None
            or spec.tokens_per_state != 1 or spec.sliding_window is not None):
        raise ValueError(f"the tract connector needs plain K/V pages (head_size == head_size_v, "
                         f"no packing, padding or sliding window), got {spec}")
    names = list(groups[0].layer_names)
    layout = KVLayout(num_layers=len(names), block_tokens=spec.block_size,
                      kv_heads=spec.num_kv_heads, head_dim=spec.head_size, dtype=spec.dtype)
    return layout, names


class TractConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tcfg = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(tcfg.kv_connector_extra_config)
        self.kv_role = str(tcfg.kv_role)
        self.saves = self.kv_role in ("kv_producer", "kv_both")
        self.loads = self.kv_role in ("kv_consumer", "kv_both")
        self.layout, self.layer_names = layout_from_kv_cache_config(kv_cache_config)
        self.layer_index = {n: i for i, n in enumerate(self.layer_names)}
        self.block_size = self.layout.block_tokens
        model = getattr(getattr(vllm_config, "model_config", None), "model", None)
        self.namespace = self.settings.namespace or model
        if not self.namespace:
            raise ValueError('the tract connector needs the model name for its keys: set '
                             '"namespace" in kv_connector_extra_config')
        if role == KVConnectorRole.SCHEDULER:
            self.rank, node_id = 0, self.settings.node_id
        else:
            self.rank = _tp_rank()
            node_id = self.settings.node_id + 1 + self.rank
        self.world_size = max(1, int(vllm_config.parallel_config.tensor_parallel_size))
        self.loop = LoopThread(f"tract-vllm-{role.name.lower()}-{node_id}")
        self.engine = self._open_engine(node_id)
        # scheduler state
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, BlockTransfer] = {}
        # worker state
        self._views: list[Any] = [None] * self.layout.num_layers
        self._layer_done: list[concurrent.futures.Future[None]] = []
        self._load_step: concurrent.futures.Future[None] | None = None
        self._load_failed: set[int] = set()
        self._saves: list[concurrent.futures.Future[None]] = []
        self._ids_cache: dict[tuple[int, str], torch.Tensor] = {}
        # CUDA loads read and validated, waiting to be written on vLLM's stream, by layer
        self._cuda_pending: dict[int, list[tuple[BlockTransfer, torch.Tensor]]] = {}

    # -- engine ---------------------------------------------------------------------------------
    def _open_engine(self, node_id: int) -> Engine:
        s = self.settings
        kw: dict[str, Any] = dict(s.engine)
        if s.seed is not None:
            kw["seed"] = s.seed
        cfg = EngineConfig(layout=self.layout, namespace=self.namespace, region=s.region,
                           create=s.create, region_bytes=s.region_bytes, max_nodes=s.max_nodes,
                           node_id=node_id, rank=self.rank, world_size=self.world_size,
                           mode=s.resolved_mode(self.kv_role), **kw)
        try:
            if s.create:
                return self.loop.call(self._open_or_attach(cfg), OPEN_TIMEOUT_S)
            return self.loop.call(_open(cfg), OPEN_TIMEOUT_S)
        except BaseException:
            self.loop.stop()
            raise

    @staticmethod
    async def _open_or_attach(cfg: EngineConfig) -> Engine:
        """``create=True`` on every instance of a rack: the first creates, the rest attach."""
        from ...errors import RegionExists
        try:
            return await Engine.open(cfg)
        except RegionExists:
            return await Engine.open(dataclasses.replace(cfg, create=False))

    def shutdown(self) -> None:
        """Wait for saves in flight, close the engine (its unfinished puts are evicted, its
        node leaves the region), stop the loop. Idempotent."""
        if not self.loop.alive:
            return
        for f in self._saves:
            with contextlib.suppress(Exception):   # logged by wait_for_save's path; closing now
                f.result(timeout=self.settings.load_timeout_s)
        self._saves.clear()
        try:
            self.loop.call(self.engine.close(), timeout=60.0)
        except Exception:
            logger.exception("tract connector: closing the engine failed")
        finally:
            self.loop.stop()

    # -- scheduler side -----------------------------------------------------------------------
    def _state(self, request: "Request") -> _RequestState:
        st = self._requests.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            cacheable = (request.prompt_token_ids is not None and not request.mm_features
                         and getattr(request, "prompt_embeds", None) is None)
            keys = None
            if cacheable:
                extra: list[Any] = []
                if request.lora_request is not None:
                    extra.append(("lora", request.lora_request.lora_name))
                if request.cache_salt:
                    extra.append(("salt", request.cache_salt))
                keys = [bytes(k) for k in self.engine.block_keys(tokens, extra_keys=extra or None)]
            st = _RequestState(keys=keys, num_prompt_tokens=len(tokens))
            self._requests[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks the region holds (see the module
        docstring); ``(None, False)`` while a consumer still waits for a remote prefill."""
        st = self._state(request)
        if not self.loads or not st.keys:
            return 0, False
        # at least one prompt token is computed here: vLLM samples from its logits
        cap = min(len(st.keys), (st.num_prompt_tokens - 1) // self.block_size)
        try:
            hit = min(self.engine.lookup(st.keys), cap)
        except TractError as e:
            logger.warning("tract connector: lookup for %s failed (%s); computing it",
                           request.request_id, e)
            return 0, False
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and hit < cap:
            now = time.monotonic()
            if st.remote_deadline is None:
                st.remote_deadline = now + self.settings.remote_wait_s
            if now < st.remote_deadline:
                return None, False           # vLLM asks again next step: nothing sleeps here
            logger.warning("tract connector: %s: %d of %d blocks arrived within remote_wait_s "
                           "(%.1f s); computing the rest", request.request_id, hit, cap,
                           self.settings.remote_wait_s)
        st.hit_blocks, st.local_tokens = hit, num_computed_tokens
        return max(0, hit * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        st.block_ids = list(blocks.get_block_ids()[0])
        # the region holds the hit's blocks: saving starts after them
        st.saved = max(st.saved, st.hit_blocks)
        if num_external_tokens <= 0 or not st.keys:
            return
        first = st.local_tokens // self.block_size
        n = num_external_tokens // self.block_size
        self._pending_loads[request.request_id] = BlockTransfer(
            request.request_id, st.keys[first:first + n], st.block_ids[first:first + n])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TractConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        for rid in scheduler_output.preempted_req_ids or ():
            st = self._requests.get(rid)
            if st is not None:
                st.block_ids = []       # freed; the resumed request comes back as new
        if not self.saves:
            return meta
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, st,
                                new.num_computed_tokens + steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._requests.get(rid)
            if st is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                st.block_ids.extend(added[0])
            self._plan_save(meta, rid, st, cached.num_computed_tokens[i] + steps.get(rid, 0))
        return meta

    def _plan_save(self, meta: TractConnectorMetadata, rid: str, st: _RequestState,
                   computed_after_step: int) -> None:
        """Save the prompt blocks this step completes (chunked prefill: a few each step)."""
        if not st.keys:
            return
        full = min(computed_after_step, st.num_prompt_tokens) // self.block_size
        full = min(full, len(st.keys), len(st.block_ids))
        if full > st.saved:
            meta.saves.append(BlockTransfer(rid, st.keys[st.saved:full],
                                            st.block_ids[st.saved:full]))
            st.saved = full

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Free now (saves are finished when the step that scheduled them returns); a
        producer's ``do_remote_decode`` request hands the decode side where its blocks are."""
        st = self._requests.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if self.saves and params.get("do_remote_decode") and st is not None:
            return False, {"do_remote_prefill": True, "do_remote_decode": False,
                           "tract_region": self.settings.region, "tract_blocks": st.saved}
        return False, None

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep each attention layer's ``[B, H, N, C]`` view, checked against the layout."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no KV cache for layers {missing[:4]}")
        for name, i in self.layer_index.items():
            view = kv_caches[name]
            check_page_view(view, self.layout, name)
            self._views[i] = view

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._ids_cache = {}       # a step's block-id tensors, built once for all its layers

    def _ids(self, t: BlockTransfer, device: torch.device) -> torch.Tensor:
        key = (id(t), str(device))
        ids = self._ids_cache.get(key)
        if ids is None:
            ids = torch.tensor(t.block_ids, dtype=torch.int64, device=device)
            self._ids_cache[key] = ids
        return ids

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Submit this step's loads (layer 0 of every request first) and return at once."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TractConnectorMetadata)
        if not meta.loads:
            self._layer_done = []
            return
        done: list[concurrent.futures.Future[None]] = [
            concurrent.futures.Future() for _ in range(self.layout.num_layers)]
        self._layer_done = done
        self._load_step = self.loop.submit(self._load_step_async(list(meta.loads), done))

    async def _load_step_async(self, loads: list[BlockTransfer],
                               done: list[concurrent.futures.Future[None]]) -> None:
        live = list(loads)
        try:
            for layer in range(self.layout.num_layers):
                view = self._views[layer]
                results = []
                for t in live:
                    results.append(await self._load_one(t, layer, view))
                failed = [t for t, ok in zip(live, results) if not ok]
                for t in failed:
                    self._load_failed.update(t.block_ids)
                live = [t for t, ok in zip(live, results) if ok]
                done[layer].set_result(None)
        finally:
            for f in done:               # an unexpected error must not hang the forward pass
                if not f.done():
                    f.set_result(None)

    async def _load_one(self, t: BlockTransfer, layer: int, view: Any) -> bool:
        """Read one request's layer into vLLM's pages; False (logged) when it failed."""
        try:
            staging = torch.empty(self.layout.kv_shape(len(t.keys), layer),
                                  dtype=self.layout.dtype, device=view.device)
            await self.engine.get_kv(t.keys, layer=layer, out=staging,
                                     timeout=self.settings.load_timeout_s)
            if view.device.type == "cpu":
                scatter_layer(view, self._ids(t, view.device), staging, self.layout)
            else:   # CUDA: written on vLLM's stream in wait_for_layer_load (same ordering)
                self._cuda_pending.setdefault(layer, []).append((t, staging))
            return True
        except (TractError, TimeoutError) as e:
            logger.warning("tract connector: load of %s (%d blocks) failed at layer %d: %s: %s; "
                           "reported as not loaded", t.req_id, len(t.keys), layer,
                           type(e).__name__, e)
            return False
        except Exception:
            logger.exception("tract connector: load of %s failed at layer %d", t.req_id, layer)
            return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer's reads landed (a Future: no polling); on CUDA, write them
        into vLLM's pages on its current stream."""
        i = self.layer_index.get(layer_name)
        if i is None or i >= len(self._layer_done):
            return
        self._layer_done[i].result()
        pending = self._cuda_pending.pop(i, None) if self._cuda_pending else None
        if pending:
            stream = torch.cuda.current_stream()
            for t, staging in pending:
                if set(t.block_ids) & self._load_failed:
                    continue
                scatter_layer(self._views[i], self._ids(t, staging.device), staging, self.layout)
                staging.record_stream(stream)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        """Submit this layer's puts of the blocks this step completes; returns at once."""
        i = self.layer_index.get(layer_name)
        meta = self._get_connector_metadata()
        assert isinstance(meta, TractConnectorMetadata)
        if i is None or not meta.saves:
            return
        for t in meta.saves:
            ids = self._ids(t, kv_layer.device)
            if kv_layer.device.type == "cpu":
                # the pages are final for this step: gathered on the loop thread, off the
                # forward pass; wait_for_save keeps them alive until the put returned
                self._saves.append(self.loop.submit(self._save_cpu(t, kv_layer, ids, i)))
            else:
                # gathered on vLLM's stream (enqueued, not waited for); the put's DMA waits
                # for the event recorded after the gather
                staging = gather_layer(kv_layer, ids, self.layout)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream())
                self._saves.append(self.loop.submit(self._save_cuda(t, staging, i, ready)))

    async def _save_cpu(self, t: BlockTransfer, view: Any, ids: Any, layer: int) -> None:
        kv = gather_layer(view, ids, self.layout)
        await self.engine.put_kv(t.keys, kv, layer=layer)

    async def _save_cuda(self, t: BlockTransfer, staging: Any, layer: int, ready: Any) -> None:
        fut = await self.engine.start_put_kv(t.keys, staging, layer=layer, ready=ready)
        await fut

    def wait_for_save(self) -> None:
        """Wait for this step's puts (the next step may overwrite their pages); a failed save
        is logged and dropped: the blocks are then simply not in the region."""
        saves, self._saves = self._saves, []
        for f in saves:
            try:
                f.result()
            except TractError as e:
                logger.warning("tract connector: a save failed (%s: %s); those blocks stay out "
                               "of the region", type(e).__name__, e)
            except Exception:
                logger.exception("tract connector: a save failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        return None, None      # no asynchronous frees or loads: saves finish in wait_for_save

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step's loads that failed (vLLM recomputes or fails them)."""
        step, self._load_step = self._load_step, None
        if step is not None:
            try:
                step.result()
            except Exception:
                logger.exception("tract connector: a load step failed")
        failed, self._load_failed = self._load_failed, set()
        return failed


async def _open(cfg: EngineConfig) -> Engine:
    return await Engine.open(cfg)


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's groups are not set up, e.g. a test)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0
