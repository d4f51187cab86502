"""The vLLM connector against the real vLLM package (issue 39).

What runs here, on the CPU: vLLM's own ``Scheduler`` (with its ``KVCacheManager``) creates the
scheduler-side ``TractConnector`` from a ``KVTransferConfig`` naming the module, exactly as
``vllm serve --kv-transfer-config`` does; the worker-side connector comes from vLLM's
``KVConnectorFactory``; the paged KV caches are allocated by vLLM's ``allocate_kv_cache``
(``[B, H, N, C]`` views, in two physical layouts); the scheduler's outputs go to the worker
connector as vLLM's model runner hands them over (bind, start_load_kv, per layer
wait_for_layer_load / save_kv_layer, wait_for_save, get_block_ids_with_load_errors) and the
results come back through ``Scheduler.update_from_output``. Two vLLM instances share one real
region file. What does not run: a model forward (vLLM's CPU kernels are not in the CUDA wheel;
the "forward" here writes random KV into the pages the step computes) and vLLM's engine
processes.

Skipped where vLLM does not import (the project's CI venv: vLLM pins a CUDA torch).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the vLLM connector needs torch")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="vLLM is not installed (pip install 'tract-async[vllm]'; the CI venv "
                           "does not install it: it pins a CUDA torch)")

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorRole)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from tract_async.errors import RegionFull  # noqa: E402
from tract_async.integrations.vllm import TractConnector  # noqa: E402
from tract_async.integrations.vllm.connector import TractConnectorMetadata  # noqa: E402

MODULE = "tract_async.integrations.vllm"
L, BS, H, D, NB = 2, 16, 2, 8, 64          # layers, block tokens, KV heads, head size, pool blocks
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
DTYPE = torch.float16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama config on disk: what vLLM's ModelConfig inspects (no weights are loaded)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, '
        '"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512, '
        '"torch_dtype": "float16", "head_dim": 8}')
    return str(d)


def kv_cache_config(layout: KVCacheLayout) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=DTYPE)
    page = spec.page_size_bytes
    if layout.is_layer_compact:      # each layer one region of NB pages
        tensor = KVCacheTensor(size=L * NB * page, layers=NAMES, layer_stride=NB * page,
                               block_stride=page)
    else:                            # each block one run of L pages
        tensor = KVCacheTensor(size=L * NB * page, layers=NAMES, layer_stride=page,
                               block_stride=L * page)
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])


def vllm_config(model_dir: str, region: str, role: str, node_id: int,
                **extra: Any) -> VllmConfig:
    ktc = KVTransferConfig(
        kv_connector="TractConnector", kv_connector_module_path=MODULE, kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"region": region, "node_id": node_id, "create": True,
                                   "region_bytes": extra.pop("region_bytes", 64 << 20),
                                   "load_timeout_s": 0.5, **extra})
    vc = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                             dtype="float16", max_model_len=512),
                    kv_transfer_config=ktc,
                    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False),
                    device_config=DeviceConfig(device="cpu"),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                                     max_model_len=512,
                                                     is_encoder_decoder=False))
    vc.cache_config.num_gpu_blocks = NB
    return vc


class Instance:
    """One vLLM instance: vLLM's Scheduler (which builds the scheduler-side connector itself)
    and a worker-side connector over KV caches that vLLM's allocator laid out."""

    def __init__(self, model_dir: str, region: str, role: str, node_id: int,
                 layout: KVCacheLayout = KVCacheLayout.LBHNC, **extra: Any) -> None:
        self.vc = vllm_config(model_dir, region, role, node_id, **extra)
        kcc = kv_cache_config(layout)
        self.scheduler = Scheduler(vllm_config=self.vc, kv_cache_config=kcc,
                                   structured_output_manager=StructuredOutputManager(self.vc),
                                   block_size=BS)
        self.worker: Any = None
        self.worker = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, kcc)
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), layout)
        self.worker.register_kv_caches(self.kv)
        self.gen = torch.Generator().manual_seed(node_id)

    @property
    def sched_conn(self) -> TractConnector:
        return self.scheduler.connector

    def add(self, rid: str, tokens: list[int], **params: Any) -> Request:
        sp = SamplingParams(max_tokens=2)
        if params:
            sp.extra_args = {"kv_transfer_params": params}
        req = Request(rid, tokens, sp, None)
        self.scheduler.add_request(req)
        return req

    def step(self) -> tuple[Any, set[int]]:
        """One engine step: schedule, run the connector's worker calls around a "forward" that
        writes random KV into the pages this step computes, report back to the scheduler."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, TractConnectorMetadata)
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)   # the connector reads no forward context
        computed = self._computed_blocks(out)
        for name in NAMES:
            w.wait_for_layer_load(name)
            view = self.kv[name]
            for b in computed:
                view[b] = torch.randn(view[b].shape, generator=self.gen).to(DTYPE)
            w.save_kv_layer(name, view, None)
        w.wait_for_save()
        failed = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        rids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=rids, sampled_token_ids=[[7] for _ in rids],
                                kv_connector_output=KVConnectorOutput(invalid_block_ids=failed))
        self.scheduler.update_from_output(out, mro)
        return out, failed

    def _computed_blocks(self, out: Any) -> list[int]:
        """Pool blocks holding tokens this step computes (not those it loads)."""
        blocks: list[int] = []
        for new in out.scheduled_new_reqs:
            first = new.num_computed_tokens
            last = first + out.num_scheduled_tokens[new.req_id]
            ids = new.block_ids[0]
            blocks += ids[first // BS:(last + BS - 1) // BS]
        return blocks

    def close(self) -> None:
        for c in (self.worker, self.sched_conn):
            if c is not None:
                c.shutdown()


@pytest.fixture
def instances(model_dir: str, region_path: str):  # noqa: ANN201
    made: list[Instance] = []

    def make(role: str, node_id: int, **kw: Any) -> Instance:
        inst = Instance(model_dir, kw.pop("region", region_path), role, node_id, **kw)
        made.append(inst)
        return inst
    yield make
    for inst in reversed(made):
        inst.close()


PROMPT = [(i * 7 + 3) % 1000 for i in range(100)]     # 6 full blocks and 4 tokens


def pages(inst: Instance, block_ids: list[int]) -> list[Any]:
    return [inst.kv[n][block_ids].clone() for n in NAMES]


def test_vllm_loads_the_connector_by_module_path(model_dir: str, region_path: str) -> None:
    """vLLM's factory resolves kv_connector + kv_connector_module_path to our class."""
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="TractConnector", kv_connector_module_path=MODULE, kv_role="kv_both",
        kv_connector_extra_config={"region": region_path}),
        device_config=DeviceConfig(device="cpu"))
    cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
    assert cls is TractConnector and issubclass(cls, KVConnectorBase_V1)


def test_bad_extra_config_is_refused(model_dir: str, region_path: str) -> None:
    vc = vllm_config(model_dir, region_path, "kv_both", 0, regoin="typo")
    with pytest.raises(ValueError, match="unknown keys \\['regoin'\\]"):
        TractConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config(KVCacheLayout.LBHNC))
    assert not os.path.exists(region_path)


def test_prefix_miss_hit_and_partial_hit_across_instances(instances: Any) -> None:
    """Instance A computes a prompt and saves it layer by layer; instance B (another node on the
    region, another physical KV layout) gets a full hit, then a partial hit, loaded bit-exact."""
    a = instances("kv_both", 0)
    b = instances("kv_both", 3, layout=KVCacheLayout.LBNHC)    # strided [B, H, N, C] views

    a.add("a1", PROMPT)
    out, failed = a.step()
    meta = out.kv_connector_metadata
    assert not meta.loads and not failed                           # miss: nothing to load
    assert out.num_scheduled_tokens["a1"] == 100
    (save,) = meta.saves                                           # the 6 full prompt blocks
    a_ids = list(save.block_ids)
    assert len(save.keys) == 6 and len(a_ids) == 6
    assert a.sched_conn.engine.lookup(save.keys) == 6

    # full hit on B: 6 blocks, capped to leave one prompt token to compute (99 // 16 = 6)
    b.add("b1", PROMPT)
    out, failed = b.step()
    meta = out.kv_connector_metadata
    (load,) = meta.loads
    assert load.keys == save.keys and not failed
    assert out.num_scheduled_tokens["b1"] == 100 - 96      # vLLM computes only the tail
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96
    assert not meta.saves                                   # the region holds them already
    for pa, pb in zip(pages(a, a_ids), pages(b, list(load.block_ids))):
        assert torch.equal(pa, pb)                          # bit-exact, across layouts

    # partial hit: the first 3 blocks agree, then the prompt diverges
    other = PROMPT[:48] + [(t + 1) % 1000 for t in PROMPT[48:]]
    b.add("b2", other)
    out, failed = b.step()
    meta = out.kv_connector_metadata
    (load,) = [t for t in meta.loads if t.req_id == "b2"]
    assert len(load.keys) == 3 and load.keys == save.keys[:3] and not failed
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48
    for pa, pb in zip(pages(a, a_ids[:3]), pages(b, list(load.block_ids))):
        assert torch.equal(pa, pb)
    (s2,) = [t for t in meta.saves if t.req_id == "b2"]     # B saves what it computed
    assert len(s2.keys) == 3 and s2.keys[0] != save.keys[3]


def test_transfer_only_prefill_to_decode(instances: Any) -> None:
    """kv_producer (prefill) -> kv_consumer (decode): the consumer waits (None, no sleep) for a
    do_remote_prefill request until the blocks arrive, loads them, and the region frees each
    block once read (transfer mode)."""
    p = instances("kv_producer", 0)
    d = instances("kv_consumer", 3)
    req = d.add("d1", PROMPT, do_remote_prefill=True)
    out, _ = d.step()
    assert "d1" not in out.num_scheduled_tokens               # not there yet: asked again later
    assert d.sched_conn.get_num_new_matched_tokens(req, 0) == (None, False)

    p.add("p1", PROMPT, do_remote_decode=True)
    out, _ = p.step()
    (save,) = out.kv_connector_metadata.saves
    assert not out.kv_connector_metadata.loads              # a producer never loads

    out, failed = d.step()
    (load,) = out.kv_connector_metadata.loads
    assert load.keys == save.keys and not failed
    assert not out.kv_connector_metadata.saves              # a consumer never saves
    for pa, pb in zip(pages(p, list(save.block_ids)), pages(d, list(load.block_ids))):
        assert torch.equal(pa, pb)
    assert d.sched_conn.engine.lookup(save.keys) == 0       # consumed: transfer-only


def test_producer_hands_kv_transfer_params_to_decode(instances: Any) -> None:
    p = instances("kv_producer", 0)
    req = p.add("p1", PROMPT, do_remote_decode=True)
    p.step()
    delay, params = p.sched_conn.request_finished(req, [])
    assert delay is False                                    # saves finished in wait_for_save
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "tract_region": p.sched_conn.settings.region, "tract_blocks": 6}


def test_blocks_gone_with_their_producer_are_reported_not_loaded(
        instances: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The producer leaves after the consumer's scheduler saw the hit (its blocks leave with
    it): the load fails, the blocks are reported as not loaded, their pages stay untouched, and
    vLLM's scheduler (recompute policy) schedules the whole prompt again."""
    a = instances("kv_both", 0)
    b = instances("kv_both", 3)
    a.add("a1", PROMPT)
    a.step()
    b.add("b1", PROMPT)
    out = b.scheduler.schedule()
    meta = out.kv_connector_metadata
    (load,) = meta.loads
    assert len(load.keys) == 6
    a.worker.shutdown()                                      # the producer's node leaves
    before = pages(b, list(load.block_ids))
    w = b.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    with caplog.at_level(logging.WARNING, logger="tract_async.integrations.vllm"):
        for name in NAMES:
            w.wait_for_layer_load(name)
        w.wait_for_save()
        failed = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    assert failed == set(load.block_ids)
    assert "reported as not loaded" in caplog.text
    for x, y in zip(before, pages(b, list(load.block_ids))):
        assert torch.equal(x, y)                             # no bytes served
    mro = ModelRunnerOutput(req_ids=["b1"], sampled_token_ids=[[7]],
                            kv_connector_output=KVConnectorOutput(invalid_block_ids=failed))
    b.scheduler.update_from_output(out, mro)
    req = b.scheduler.requests["b1"]
    assert req.num_computed_tokens == 0                      # vLLM recomputes them


def test_evicted_between_lookup_and_load_is_reported(instances: Any) -> None:
    """A block evicted after the scheduler's lookup (here: another writer fills a small cache
    region, LRU evicts the prompt) is reported as not loaded, not served."""
    region_bytes = 4 << 20
    a = instances("kv_both", 0, region_bytes=region_bytes)
    b = instances("kv_both", 3, region_bytes=region_bytes)
    a.add("a1", PROMPT)
    a.step()
    b.add("b1", PROMPT)
    out = b.scheduler.schedule()
    (load,) = out.kv_connector_metadata.loads
    # fill the region from A's worker node, which owns the chunks holding the prompt, until
    # its LRU eviction took the prompt's blocks
    eng = a.worker.engine
    i = 0
    while eng.lookup(load.keys) == 6 and i < 200:
        keys = eng.block_keys([5000 + i] * (BS * 8))
        kv = torch.zeros(eng.layout.kv_shape(len(keys)), dtype=DTYPE)
        with contextlib.suppress(RegionFull):   # an index window full of fresh blocks
            a.worker.loop.call(eng.put_kv(keys, kv, timeout=0.5))
        i += 1
    assert eng.lookup(load.keys) < 6, "the filler never evicted the prompt"
    w = b.worker
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    for name in NAMES:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set(load.block_ids)
    w.clear_connector_metadata()


def test_full_region_drops_saves_and_serving_goes_on(
        instances: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A transfer-only region that is full (nothing evictable): saves fail with RegionFull,
    are logged, and the step completes; the consumer finds nothing and computes."""
    p = instances("kv_producer", 0, region_bytes=4 << 20)
    eng = p.worker.engine
    fails = 0
    for i in range(5000):            # fill it with unread transfers until puts keep failing
        keys = eng.block_keys([9000 + i] * BS)
        try:
            p.worker.loop.call(eng.put_kv(keys, torch.zeros(
                eng.layout.kv_shape(len(keys)), dtype=DTYPE), timeout=0.2))
            fails = 0
        except RegionFull:
            fails += 1
            if fails == 8:
                break
    assert fails == 8, "the region never filled up"
    p.add("p1", PROMPT)
    with caplog.at_level(logging.WARNING, logger="tract_async.integrations.vllm"):
        out, _ = p.step()
    (save,) = out.kv_connector_metadata.saves
    assert "a save failed (RegionFull" in caplog.text
    assert eng.lookup(save.keys) == 0
