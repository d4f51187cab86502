"""Batched decode (serving/fast_decode.py, serving/batching.py): the tokens of every request equal
the single-process reference however requests join, leave, fail or are cancelled."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tract_async.serving.batching import DecodeBatcher
from tract_async.serving.errors import NothingToCompute
from tract_async.serving.fast_decode import (MIN_BUCKET, BatchDecoder, DecodeCapacityError,
                                             bucket)
from tract_async.serving.kv_cache import build_cache
from tract_async.serving.model import (build_model, cache_kwargs, llama3_8b_config, prefill,
                                       reference_generate, tiny_llama_config)

SEED = 0
N_NEW = 12


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(tiny_llama_config(), SEED)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def first_pass(model: torch.nn.Module, ids: list[int]) -> tuple[int, list]:
    cache = build_cache(model.config.num_hidden_layers)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=model.lm_head.weight.device),
                    **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax()), [(layer.keys, layer.values) for layer in cache.layers]


def test_bucket() -> None:
    assert bucket(1) == MIN_BUCKET and bucket(MIN_BUCKET) == MIN_BUCKET
    assert bucket(MIN_BUCKET + 1) == 2 * MIN_BUCKET and bucket(5000) == 8192


def test_batch_decoder_matches_reference_with_staggered_joins(model: torch.nn.Module) -> None:
    ps = prompts(5, 37, 300, 64, 129, 17)
    refs = [reference_generate(model, p, N_NEW) for p in ps]
    dec = BatchDecoder(model, max_batch=4, max_len=600)
    assert not dec.graphs                      # a CPU model runs the step eagerly
    out: dict[int, list[int]] = {}
    slots: list[int] = []                      # prompt index per slot
    pending = list(range(len(ps)))
    seen_batch = 0
    while pending or slots:
        if pending and dec.free_slots():       # one join per step: requests overlap unevenly
            i = pending.pop(0)
            token, layers = first_pass(model, ps[i])
            assert dec.admit(layers) == len(slots)
            out[i] = [token]
            slots.append(i)
        seen_batch = max(seen_batch, len(slots))
        for i, token in zip(slots, dec.step([out[i][-1] for i in slots])):
            out[i].append(token)
        for s in reversed(range(len(slots))):
            if len(out[slots[s]]) >= N_NEW:
                moved = dec.release(s)
                if moved is None:
                    slots.pop(s)
                else:                          # the last slot's request now lives at s
                    slots[s] = slots.pop(moved)
    assert seen_batch == 4
    for i, ref in enumerate(refs):
        assert out[i][:N_NEW] == ref, f"prompt {i}"


def test_buckets_cover_every_step(model: torch.nn.Module) -> None:
    dec = BatchDecoder(model, max_batch=8, max_len=9000)
    assert dec.max_len == 9216                 # whole smallest buckets
    spans = [256, 512, 1024, 2048, 4096, 8192, 9216]
    assert dec.buckets() == ([("step", b, s) for b in (1, 2, 4, 8) for s in spans]
                             + [("extend", n, s) for n in (1, 2, 4, 8, 16) for s in spans])
    assert dec.capture_all() == 0              # the CPU runs steps eagerly


def test_extend_matches_reference_and_checks_its_tail(model: torch.nn.Module) -> None:
    dec = BatchDecoder(model, max_batch=2, max_len=MIN_BUCKET)
    for n in (40, 47, 33):                     # tails of 8, 15 and 1 tokens after 32 past
        ids = prompts(n, seed=n)[0]
        ref = reference_generate(model, ids, 6)
        token = dec.admit_extend(list(prefill(model, ids[:32]).kv), 32, ids[32:])
        out = [token]
        while len(out) < 6:
            out.append(dec.step([out[-1]])[0])
        assert out == ref, n
        dec.release(0)
    kv = list(prefill(model, prompts(60)[0]).kv)
    with pytest.raises(ValueError, match="1..16 tokens"):
        dec.admit_extend(kv, 32, list(range(17)))
    with pytest.raises(DecodeCapacityError, match="no room"):
        dec.admit_extend(kv, MIN_BUCKET - 4, [1, 2, 3])
    assert dec.extends == 3 and dec.active == 0


def test_streamed_extend_equals_whole_extend(model: torch.nn.Module) -> None:
    dec = BatchDecoder(model, max_batch=2, max_len=MIN_BUCKET)
    ids = prompts(45, seed=9)[0]
    past = list(prefill(model, ids[:32]).kv)
    whole = dec.admit_extend(past, 32, ids[32:])
    with pytest.raises(RuntimeError, match="no extend is streaming"):
        dec.stream_layer(0, past[0])
    dec.stream_begin(32, ids[32:])
    with pytest.raises(RuntimeError, match="already streaming"):
        dec.stream_begin(32, ids[32:])
    for i, kv in enumerate(past):
        dec.stream_layer(i, kv)
    assert dec.stream_end() == whole == reference_generate(model, ids, 1)[0]
    assert dec.active == 2 and dec.lens[:2] == [45, 45]
    a, b = dec.step([whole, whole])
    assert a == b == reference_generate(model, ids, 2)[1]
    dec.release(1)
    dec.stream_begin(32, ids[32:])
    dec.stream_abort()                         # the reserved slot was never made active
    assert dec.active == 1 and dec.streams == 1


def test_batch_decoder_capacity(model: torch.nn.Module) -> None:
    dec = BatchDecoder(model, max_batch=1, max_len=MIN_BUCKET)
    _, layers = first_pass(model, prompts(MIN_BUCKET)[0])
    with pytest.raises(DecodeCapacityError, match="no room"):
        dec.admit(layers)
    _, layers = first_pass(model, prompts(10)[0])
    dec.admit(layers)
    with pytest.raises(DecodeCapacityError, match="busy"):
        dec.admit(layers)
    with pytest.raises(ValueError, match="one token per active slot"):
        dec.step([1, 2])
    with pytest.raises(IndexError):
        dec.release(1)
    assert dec.release(0) is None and dec.active == 0


def layer_source(model: torch.nn.Module, ids: list[int], past_len: int, *,
                 delay: float = 0.0, fail_at: int | None = None):
    """``get_layer`` serving the prompt's own KV, each layer after ``delay`` seconds (a prefill
    still producing), or raising at ``fail_at``."""
    kv = prefill(model, ids).kv

    async def get_layer(i: int) -> torch.Tensor:
        await asyncio.sleep(delay)
        if i == fail_at:
            raise RuntimeError(f"layer {i} is gone")
        return kv[i, :, :past_len]
    return get_layer


async def test_batcher_concurrent_requests_match_reference(model: torch.nn.Module) -> None:
    ps = prompts(40, 90, 33, 250, 16, 64, 120, 48, 17)
    refs = [reference_generate(model, p, N_NEW) for p in ps]
    batcher = DecodeBatcher(model, max_batch=4, max_len=512)
    streamed: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    try:
        async def one(i: int) -> list[int]:
            await asyncio.sleep(0.002 * i)
            ids = ps[i]
            past = (len(ids) // 16) * 16 if i % 3 else 0     # some recompute the whole prompt
            past = min(past, len(ids) - 1)
            get = layer_source(model, ids, past, delay=0.001) if past else None
            return await batcher.generate(ids, get_layer=get, past_len=past,
                                          max_new_tokens=N_NEW, on_token=streamed[i].append)
        results = await asyncio.gather(*(one(i) for i in range(len(ps))))
    finally:
        await batcher.aclose()
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert res == ref, f"prompt {i}"
        assert streamed[i] == ref, f"streamed tokens of prompt {i}"
    assert batcher.max_seen_batch > 1 and batcher.steps < len(ps) * (N_NEW - 1)


async def test_batcher_failure_and_cancellation_stay_with_their_request(
        model: torch.nn.Module) -> None:
    ps = prompts(64, 80, 96, 50)
    refs = [reference_generate(model, p, 40) for p in ps]
    batcher = DecodeBatcher(model, max_batch=4, max_len=512)
    try:
        ok = asyncio.create_task(batcher.generate(ps[0], get_layer=None, past_len=0,
                                                  max_new_tokens=40))
        bad = asyncio.create_task(batcher.generate(
            ps[1], get_layer=layer_source(model, ps[1], 64, fail_at=2), past_len=64,
            max_new_tokens=40))
        slow = asyncio.create_task(batcher.generate(
            ps[2], get_layer=layer_source(model, ps[2], 80, delay=0.05), past_len=80,
            max_new_tokens=40))
        started = asyncio.Event()
        cancelled = asyncio.create_task(batcher.generate(
            ps[3], get_layer=None, past_len=0, max_new_tokens=40,
            on_token=lambda t: started.set()))
        await started.wait()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(RuntimeError, match="layer 2 is gone"):
            await bad
        assert await ok == refs[0]
        assert await slow == refs[2]
        # the batch goes on after all that
        assert await batcher.generate(ps[3], get_layer=None, past_len=0,
                                      max_new_tokens=40) == refs[3]
    finally:
        await batcher.aclose()


async def test_batcher_streams_layers_when_the_kv_is_not_in_hand(model: torch.nn.Module) -> None:
    """Not ``ready()`` and nobody decoding: the extend runs layer by layer as the KV lands
    (overlapping a prefill still producing) instead of waiting for every layer."""
    ids = prompts(70, seed=5)[0]
    asked: list[int] = []
    source = layer_source(model, ids, 64, delay=0.002)

    async def get_layer(i: int) -> torch.Tensor:
        asked.append(i)
        return await source(i)
    batcher = DecodeBatcher(model, max_batch=2, max_len=512)
    try:
        got = await batcher.generate(ids, get_layer=get_layer, past_len=64,
                                     max_new_tokens=N_NEW, ready=lambda: False)
    finally:
        await batcher.aclose()
    assert got == reference_generate(model, ids, N_NEW)
    assert asked == list(range(model.config.num_hidden_layers))
    assert batcher.decoder.streams == batcher.decoder.extends == 1
    assert batcher.decoder.active == 0


async def test_batcher_long_request_runs_alone_and_eos_ends_early(model: torch.nn.Module) -> None:
    batcher = DecodeBatcher(model, max_batch=2, max_len=MIN_BUCKET)
    try:
        long_ids = prompts(MIN_BUCKET - 4)[0]          # + 12 new tokens > max_len
        assert await batcher.generate(long_ids, get_layer=None, past_len=0,
                                      max_new_tokens=N_NEW) == reference_generate(
            model, long_ids, N_NEW)
        ids = prompts(30, seed=3)[0]
        ref = reference_generate(model, ids, N_NEW)
        eos = ref[4]
        got = await batcher.generate(ids, get_layer=None, past_len=0, max_new_tokens=N_NEW,
                                     eos_token_id=eos)
        assert got == ref[:ref.index(eos) + 1]
        with pytest.raises(NothingToCompute):
            await batcher.generate(ids, get_layer=None, past_len=len(ids), max_new_tokens=2)
        assert await batcher.generate(ids, get_layer=None, past_len=0, max_new_tokens=0) == []
    finally:
        await batcher.aclose()
    with pytest.raises(asyncio.CancelledError):
        await batcher.generate(ids, get_layer=None, past_len=0, max_new_tokens=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_equal_eager_steps() -> None:
    """The Llama-3-8B geometry in bf16: graph replays give the eager step's tokens, for a
    request admitted after transformers' pass, one extended whole and one extended layer by
    layer."""
    model = build_model(llama3_8b_config(), SEED, device="cuda", init_device="cuda", attn="sdpa")
    ps = [list(range(1000 + 7 * j, 1000 + 7 * j + n)) for j, n in enumerate((40, 300, 129))]
    runs = []
    for graphs in (False, True):
        dec = BatchDecoder(model, max_batch=4, max_len=1024, graphs=graphs)
        if graphs:   # a capture on another thread while this one keeps launching work
            import threading
            stop = threading.Event()

            def other_work() -> None:
                x = torch.ones(1 << 20, device="cuda")
                while not stop.is_set():
                    x.mul_(1.0)
                    torch.cuda.current_stream().query()

            worker = threading.Thread(target=other_work)
            worker.start()
            try:
                n = dec.capture_all(stream=True)
            finally:
                stop.set()
                worker.join()
            # steps of batches 1, 2, 4 and extends of 1..16 tokens over spans 256-1024, and
            # the streaming parts: prologues, 32 layers and heads
            assert n == len(dec.buckets(stream=True)) == 3 * 3 + 5 * 3 + 5 * 3 + 32 * 5 * 3 + 5
        tokens = []
        for j, p in enumerate(ps):
            past = (len(p) - 1) // 16 * 16
            if j == 0:
                t, layers = first_pass(model, p)
                dec.admit(layers)
            elif j == 1:
                t = dec.admit_extend(list(prefill(model, p[:past]).kv), past, p[past:])
            else:
                dec.stream_begin(past, p[past:])
                for i, kv in enumerate(prefill(model, p[:past]).kv):
                    dec.stream_layer(i, kv)
                t = dec.stream_end()
            tokens.append([t])
        for _ in range(20):
            for seq, t in zip(tokens, dec.step([seq[-1] for seq in tokens])):
                seq.append(t)
        runs.append(tokens)
        assert dec.captures == (n if graphs else 0)     # no capture while serving
    assert runs[0] == runs[1]
