"""GPU <-> region transfers on a real device: bit-exact round trips (contiguous and paged, all
layers and layer by layer, every copy method, bf16/fp16/fp32), across processes, through the
pinned fallback, with producer events and StreamFutures.

Sync tests around asyncio.run: they need neither pytest-asyncio nor pytest-timeout.
Skipped without CUDA (conftest); run on the device with ``bench/gpu_suite.sh``.
"""
from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import tract_async as tract
from tract_async.keys import keys_to_words

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
METHODS = ["auto", "direct", "dma", "dma2d", "zerocopy"]


def layout(dtype=torch.bfloat16, *, L=4, T=16, H=8, D=128):
    return tract.KVLayout(num_layers=L, block_tokens=T, kv_heads=H, head_dim=D, dtype=dtype)


def cfg(path, lay, *, create=True, node_id=0, size=256 << 20, **kw):
    return tract.EngineConfig(region=path, region_bytes=size, create=create, node_id=node_id,
                              layout=lay, namespace="gpu-test", **kw)


def rand_kv(lay, n, seed, layer=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(lay.kv_shape(n, layer), generator=g).to(lay.dtype)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8).cpu(),
                                              b.contiguous().view(torch.uint8).cpu())


def tokens(n, lay, salt=0):
    return [(salt * 7919 + i) % 50000 for i in range(n * lay.block_tokens)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_contiguous_round_trip_all_layers_and_by_layer(region_path, dtype, method):
    lay = layout(dtype)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            eng.cuda_setup(method=method)
            n = 5
            keys = eng.block_keys(tokens(n, lay, 1))
            kv = rand_kv(lay, n, 1)
            assert await eng.put_kv(keys, kv.cuda()) == n
            # the region holds what the CPU path would read
            assert same_bits(await eng.get_kv(keys), kv)
            got = await eng.get_kv(keys, device="cuda")
            assert got.is_cuda and same_bits(got, kv)
            out = torch.empty_like(kv, device="cuda")
            assert same_bits(await eng.get_kv(keys, out=out), kv)
            # layer by layer, a second request; skipped blocks: a put of a prefix is a no-op
            keys2 = eng.block_keys(tokens(n, lay, 2))
            kv2 = rand_kv(lay, n, 2)
            for i in range(lay.num_layers):
                assert await eng.put_kv(keys2, kv2[i].cuda(), layer=i) == n
            for i in range(lay.num_layers):
                assert same_bits(await eng.get_kv(keys2, layer=i, device="cuda"), kv2[i])
            assert same_bits(await eng.get_kv(keys2, device="cuda"), kv2)
            assert await eng.put_kv(keys2[:3], kv2[:, :, :3 * lay.block_tokens].cuda()) == 0
            # a subset of blocks that mixes present and new ones (non-consecutive positions)
            keys3 = eng.block_keys(tokens(n + 2, lay, 1))      # first n present, 2 new
            kv3 = torch.cat([kv, rand_kv(lay, 2, 3)], dim=2)
            assert await eng.put_kv(keys3, kv3.cuda()) == 2
            assert same_bits(await eng.get_kv(keys3, device="cuda"), kv3)
            st = eng.stats()["cuda"]
            assert st["registered"] is True and st["outstanding"] == 0
            dev = next(iter(st["devices"].values()))
            assert dev["transfers"] > 0
            if method != "auto":
                avail = {"dma": True, "dma2d": dev["dma2d"], "zerocopy": dev["zerocopy"],
                         "direct": dev["dma2d"]}[method]
                if avail:
                    assert dev["by_method"].get(method, 0) > 0, dev
    asyncio.run(main())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["list", "stacked", "list-nb2"])
@pytest.mark.parametrize("method", METHODS)
def test_paged_round_trip(region_path, dtype, form, method):
    lay = layout(dtype)
    L, T, H, D = lay.num_layers, lay.block_tokens, lay.kv_heads, lay.head_dim
    nb = 32

    def make_pool(fill):
        shape = (nb, 2, T, H, D) if form.endswith("nb2") else (2, nb, T, H, D)
        pools = [fill(shape) for _ in range(L)]
        return torch.stack(pools) if form == "stacked" else pools

    def pool_block(pool, layer, b):
        p = pool[layer]
        return p[b] if form.endswith("nb2") else p[:, b]       # (2, T, H, D)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            eng.cuda_setup(method=method)
            layout_arg = "nb2" if form.endswith("nb2") else "2nb"
            g = torch.Generator(device="cuda").manual_seed(5)
            pool = make_pool(lambda s: torch.randn(s, generator=g, device="cuda").to(dtype))
            n = 6
            ids = [17, 3, 30, 4, 11, 0]
            keys = eng.block_keys(tokens(n, lay, 9))
            assert await eng.put_kv_paged(keys, pool, ids, pool_layout=layout_arg) == n
            # reference: the contiguous form of those blocks
            ref = torch.stack([torch.cat([pool_block(pool, l, b) for b in ids], dim=1)
                               for l in range(L)])
            assert same_bits(await eng.get_kv(keys), ref)
            # into another pool at other blocks, all layers then layer by layer
            dst = make_pool(lambda s: torch.zeros(s, dtype=dtype, device="cuda"))
            ids2 = [1, 2, 3, 28, 29, 9]
            await eng.get_kv_paged(keys, dst, ids2, pool_layout=layout_arg)
            for l in range(L):
                for b, b2 in zip(ids, ids2):
                    assert same_bits(pool_block(dst, l, b2), pool_block(pool, l, b))
            dst2 = make_pool(lambda s: torch.zeros(s, dtype=dtype, device="cuda"))
            for l in range(L):
                await eng.get_kv_paged(keys, dst2, ids2, layer=l, pool_layout=layout_arg)
            for l in range(L):
                for b, b2 in zip(ids, ids2):
                    assert same_bits(pool_block(dst2, l, b2), pool_block(pool, l, b))
            # layer-wise paged put of a new request, single-layer pool tensors
            keys2 = eng.block_keys(tokens(n, lay, 10))
            for l in range(L):
                one = pool[l]
                assert await eng.put_kv_paged(keys2, one, ids, layer=l,
                                              pool_layout=layout_arg) == n
            assert same_bits(await eng.get_kv(keys2), ref)
    asyncio.run(main())


@pytest.mark.parametrize("method", METHODS)
def test_tiny_rows_and_odd_geometry(region_path, method):
    """128-byte rows, and 48-byte rows (odd token count; a 4-word Triton block)."""
    async def main():
        for lay in (layout(torch.float16, L=3, T=4, H=2, D=8),
                    layout(torch.float16, L=2, T=3, H=1, D=8)):
            path = f"{region_path}-{lay.half_layer_bytes}"
            async with tract.Engine.open(cfg(path, lay, size=16 << 20)) as eng:
                eng.cuda_setup(method=method)
                keys = eng.block_keys(tokens(7, lay, 4))
                kv = rand_kv(lay, 7, 4)
                await eng.put_kv(keys, kv.cuda())
                assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
                assert same_bits(await eng.get_kv(keys, layer=1, device="cuda"), kv[1])
            os.unlink(path)
    asyncio.run(main())


def test_put_waits_on_the_producer_stream_event(region_path):
    """The producer writes kv on its own stream after a long sleep kernel; ready=stream makes
    the DMA wait for it (no device synchronize anywhere)."""
    lay = layout(torch.bfloat16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 8
            keys = eng.block_keys(tokens(n, lay, 11))
            want = rand_kv(lay, n, 11).cuda()
            kv = torch.zeros_like(want)
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                torch.cuda._sleep(200_000_000)                    # ~0.1 s of GPU time
                kv.copy_(want)
            fut = await eng.start_put_kv(keys, kv, ready=s)
            assert not fut.done()                                 # still behind the sleep
            assert await fut == n
            assert same_bits(await eng.get_kv(keys), want)
    asyncio.run(main())


def test_stream_future_wait_stream_orders_consumer_work(region_path):
    lay = layout(torch.float16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 64
            keys = eng.block_keys(tokens(n, lay, 12))
            kv = rand_kv(lay, n, 12)
            await eng.put_kv(keys, kv.cuda())
            consumer = torch.cuda.Stream()
            out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
            fut = await eng.start_get_kv(keys, out=out)
            with torch.cuda.stream(consumer):
                fut.wait_stream(consumer)             # ordered after the DMA, no host sync
                doubled = out.float() * 2             # speculative until the await validates
            assert await fut is out
            consumer.synchronize()
            assert torch.equal(doubled.cpu(), kv.float() * 2)
            assert fut.t_completed is not None and fut.t_landed_seen is not None
    asyncio.run(main())


def test_fallback_without_registration(region_path, monkeypatch):
    monkeypatch.setenv("TRACT_CUDA_NO_REGISTER", "1")
    lay = layout(torch.bfloat16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 3
            keys = eng.block_keys(tokens(n, lay, 13))
            kv = rand_kv(lay, n, 13)
            await eng.put_kv(keys, kv.cuda())
            assert same_bits(await eng.get_kv(keys), kv)
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
            pool = [torch.zeros((2, 8, lay.block_tokens, lay.kv_heads, lay.head_dim),
                                dtype=lay.dtype, device="cuda") for _ in range(lay.num_layers)]
            await eng.get_kv_paged(keys, pool, [5, 0, 2])
            for l in range(lay.num_layers):
                assert same_bits(pool[l][:, 5], kv[l, :, :lay.block_tokens])
            st = eng.stats()["cuda"]
            assert st["registered"] is False and st["fallback"] == "pinned-staging"
            assert "TRACT_CUDA_NO_REGISTER" in st["reason"]
    asyncio.run(main())


_CHILD = textwrap.dedent("""
    import asyncio, sys, torch
    import tract_async as tract
    path, dtype_name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    dtype = getattr(torch, dtype_name)
    lay = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=8, head_dim=128, dtype=dtype)
    def rand_kv(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(lay.kv_shape(n), generator=g).to(dtype)
    async def main():
        cfg = tract.EngineConfig(region=path, create=False, node_id=1, layout=lay,
                                 namespace="gpu-test")
        async with tract.Engine.open(cfg) as eng:
            toks = list(range(6 * 16))
            keys = eng.block_keys(toks)
            if mode == "get":
                got = await eng.get_kv(keys, device="cuda", timeout=30)
                ok = torch.equal(got.cpu().view(torch.uint8), rand_kv(6, 21).view(torch.uint8))
                print("child-get", "ok" if ok else "MISMATCH", flush=True)
                return
            keys2 = eng.block_keys([t + 1 for t in toks])
            kv = rand_kv(6, 22).cuda()
            print("child-ready", flush=True)
            for i in range(lay.num_layers):          # layer by layer, slowly
                await asyncio.sleep(0.05)
                await eng.put_kv(keys2, kv[i], layer=i)
            print("child-put-done", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    asyncio.run(main())
""")


@pytest.mark.parametrize("dtype", DTYPES)
def test_across_processes(region_path, dtype):
    """This process puts from the GPU, a child reads into its GPU; then the child streams layers
    from its GPU while this process waits for each layer and reads it into its own."""
    lay = layout(dtype)
    name = str(dtype).split(".")[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            toks = list(range(6 * 16))
            keys = eng.block_keys(toks)
            await eng.put_kv(keys, rand_kv(lay, 6, 21).cuda())
            p = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHILD, region_path,
                                                     name, "get", env=env,
                                                     stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(p.communicate(), 120)
            assert p.returncode == 0 and b"child-get ok" in out, out
            p = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHILD, region_path,
                                                     name, "put", env=env,
                                                     stdin=asyncio.subprocess.PIPE,
                                                     stdout=asyncio.subprocess.PIPE)
            try:
                line = await asyncio.wait_for(p.stdout.readline(), 120)
                assert b"child-ready" in line, line
                keys2 = eng.block_keys([t + 1 for t in toks])
                want = rand_kv(lay, 6, 22)
                for i in range(lay.num_layers):          # waits for each layer as it lands
                    got = await eng.get_kv(keys2, layer=i, device="cuda", timeout=60)
                    assert same_bits(got, want[i]), f"layer {i}"
                line = await asyncio.wait_for(p.stdout.readline(), 60)
                assert b"child-put-done" in line
                assert same_bits(await eng.get_kv(keys2, device="cuda", timeout=10), want)
            finally:
                p.stdin.write(b"bye\n")
                await p.stdin.drain()
                await asyncio.wait_for(p.wait(), 60)
            assert p.returncode == 0
    asyncio.run(main())


def test_cancelled_get_waits_for_its_bytes_and_engine_closes_clean(region_path):
    lay = layout(torch.bfloat16)

    async def main():
        # no wait spin: an awaiter that spins on its landing transfer completes the whole get
        # in its first step, before a cancel can reach it (the H100 run of 2026-12-06 did):
        # this test is about a get cancelled while its DMA is in flight
        eng = await tract.Engine.open(cfg(region_path, lay, wait_spin_us=0))
        try:
            n = 64
            keys = eng.block_keys(tokens(n, lay, 14))
            kv = rand_kv(lay, n, 14).cuda()
            await eng.put_kv(keys, kv)
            t = asyncio.ensure_future(eng.get_kv(keys, device="cuda"))
            await asyncio.sleep(0)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            await asyncio.sleep(0.01)
            assert eng.stats()["cuda"]["outstanding"] == 0      # the cancelled read landed
            # detached put: its publication happens on landing, close drains it
            keys2 = eng.block_keys(tokens(n, lay, 15))
            await eng.start_put_kv(keys2, kv)
        finally:
            await eng.close()
        assert eng.stats()["cuda"] is None
    asyncio.run(main())


def test_telemetry_samples_on_the_device(region_path):
    lay = layout(torch.bfloat16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            s = eng.start_telemetry(interval_s=0.02)
            keys = eng.block_keys(tokens(64, lay, 16))
            kv = rand_kv(lay, 64, 16).cuda()
            for _ in range(3):
                await eng.put_kv(keys, kv)
                await eng.get_kv(keys, device="cuda")
            await asyncio.sleep(0.2)
            await eng.stop_telemetry()
            ser = s.series()
            if s.available:
                assert len(ser["t_s"]) >= 2 and all(x >= 0 for x in ser["power_w"])
    asyncio.run(main())


def test_gpu_rows_match_numpy_reference_for_random_pool_ids(region_path):
    """Random (non-affine) ids over many blocks: index gather path, pieces smaller than the
    transfer, compared with a numpy reference built from the CPU path."""
    lay = layout(torch.bfloat16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay, size=512 << 20)) as eng:
            eng.cuda_setup(piece_bytes=1 << 20)                   # many pieces
            nb, n = 300, 200
            rng = np.random.default_rng(0)
            ids = rng.permutation(nb)[:n]
            g = torch.Generator(device="cuda").manual_seed(7)
            pool = torch.randn((lay.num_layers, 2, nb, lay.block_tokens, lay.kv_heads,
                                lay.head_dim), generator=g, device="cuda").to(lay.dtype)
            keys = eng.block_keys(tokens(n, lay, 17))
            await eng.put_kv_paged(keys, pool, ids)
            ref = pool[:, :, torch.as_tensor(ids, device="cuda")].flatten(2, 3)
            assert same_bits(await eng.get_kv(keys), ref)
            back = torch.zeros_like(pool)
            await eng.get_kv_paged(keys, back, ids)
            sel = torch.as_tensor(ids, device="cuda")
            assert same_bits(back[:, :, sel], pool[:, :, sel])
    asyncio.run(main())


@pytest.mark.parametrize("method", ["auto", "zerocopy"])
def test_large_put_is_exact_and_all_or_nothing(region_path, method):
    """A put of a few thousand blocks with present blocks mixed in is bit-exact; one that does
    not fit raises RegionFull and leaves none of its blocks behind."""
    from tract_async import errors
    lay = layout(torch.float16, L=2, T=16, H=2, D=32)        # 8 KiB blocks
    n = 2085

    async def main():
        async with tract.Engine.open(cfg(region_path, lay, size=96 << 20)) as eng:
            eng.cuda_setup(method=method)
            keys = eng.block_keys(tokens(n, lay, 11))
            kv = rand_kv(lay, n, 11)
            await eng.put_kv(keys[:5], kv[:, :, :5 * lay.block_tokens].cuda())
            assert await eng.put_kv(keys, kv.cuda()) == n - 5
            assert eng.lookup(keys) == n
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
            m = (96 << 20) // lay.block_bytes + 16
            keys2 = eng.block_keys(tokens(m, lay, 12))
            kv2 = torch.zeros(lay.kv_shape(m), dtype=lay.dtype, device="cuda")
            with pytest.raises(errors.RegionFull):
                await eng.put_kv(keys2, kv2)
            assert eng.lookup(keys2) == 0
            assert eng.stats()["cuda"]["outstanding"] == 0
    asyncio.run(main())


def test_a_layer_is_published_while_the_producers_loop_is_blocked(region_path):
    """The put's DMA waits behind a long kernel; the producer's loop thread then blocks in a
    CUDA synchronize (as sampling does). The layer bits are out before that thread returns:
    the poller's early publish, not the loop, stored them; the loop's bookkeeping runs later."""
    lay = layout(torch.bfloat16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 16                                      # a FillBatch
            keys = eng.block_keys(tokens(n, lay, 31))
            kv = rand_kv(lay, n, 31).cuda()
            await eng.put_kv(keys, kv[0], layer=0)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                torch.cuda._sleep(100_000_000)
            fut = await eng.start_put_kv(keys, kv[1], layer=1, ready=s)
            torch.cuda.synchronize()                    # the loop's thread blocks here
            deadline = time.monotonic() + 2.0
            while not fut.early_done and time.monotonic() < deadline:
                time.sleep(0.001)                       # still not yielding to the loop
            assert fut.early_done and not fut.done()
            words = keys_to_words(keys)
            bits = eng._store.blocks.index.snapshot(words)[:, 5]
            assert all(int(x) & 0b11 == 0b11 for x in bits)
            assert await fut == n
            for i in range(2, lay.num_layers):
                await eng.put_kv(keys, kv[i], layer=i)
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
            assert eng._store.blocks.stats.early_publishes >= 1
    asyncio.run(main())


def test_gpu_reads_invalidate_only_what_this_hosts_cpu_read(region_path):
    lay = layout(torch.bfloat16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 12
            keys = eng.block_keys(tokens(n, lay, 32))
            kv = rand_kv(lay, n, 32)
            await eng.put_kv(keys, kv.cuda())
            marks = eng._store.blocks.cpu_marks
            marks.marks[:] = 0                          # a settled record
            inv = marks.invalidated
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
            assert marks.invalidated == inv             # nothing this host's CPU read
            assert same_bits(await eng.get_kv(keys[:5]), kv[:, :, :5 * lay.block_tokens])
            assert same_bits(await eng.get_kv(keys, layer=2, device="cuda"), kv[2])
            assert marks.invalidated == inv + 5         # the five the CPU read, that layer
            assert same_bits(await eng.get_kv(keys, layer=2, device="cuda"), kv[2])
            assert marks.invalidated == inv + 5
    asyncio.run(main())


def test_direct_copies_across_two_requests_blocks(region_path):
    """A read whose keys interleave two requests' blocks (two runs of payload offsets, in
    alternation): more 2-D copies, the same bytes; a layer put into such a list is exact too."""
    lay = layout(torch.float16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            eng.cuda_setup(method="direct")
            n = 10
            ka = eng.block_keys(tokens(n, lay, 33))
            kb = eng.block_keys(tokens(n, lay, 34))
            kva, kvb = rand_kv(lay, n, 33), rand_kv(lay, n, 34)
            await eng.put_kv(ka, kva.cuda())
            for i in range(lay.num_layers):
                await eng.put_kv(kb, kvb[i].cuda(), layer=i)
            T = lay.block_tokens
            mixed = [k for pair in zip(ka, kb) for k in pair]
            want = torch.cat([torch.cat([kva[:, :, j * T:(j + 1) * T], kvb[:, :, j * T:(j + 1) * T]],
                                        dim=2) for j in range(n)], dim=2)
            assert same_bits(await eng.get_kv(mixed, device="cuda"), want)
            assert same_bits(await eng.get_kv(mixed, layer=3, device="cuda"), want[3])
            dev = next(iter(eng.stats()["cuda"]["devices"].values()))
            assert dev["by_method"].get("direct", 0) >= 2 + lay.num_layers, dev
    asyncio.run(main())


@pytest.mark.parametrize("mode", ["auto", "all", "off"])
def test_batched_copies_of_scattered_blocks_are_exact(region_path, monkeypatch, mode):
    """Blocks of two requests read in alternation (one run per block) go as one batch of 1-D
    copies where the runtime has them (``cuda/direct.py``, "Batches"): the same bytes as the 2-D
    copies, for whole blocks and for every layer, into the region and out of it; ``off``
    (``TRACT_CUDA_BATCH``) keeps the 2-D copies."""
    monkeypatch.setenv("TRACT_CUDA_BATCH", mode)
    lay = layout(torch.bfloat16)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            copier = eng.cuda_setup(method="direct").copier(
                torch.device("cuda", torch.cuda.current_device()))
            if mode == "off":
                assert copier.batch == "off" and "TRACT_CUDA_BATCH" in copier.batch_reason
            elif copier.batch == "off":
                pytest.skip(f"no batched copies here: {copier.batch_reason}")
            n = 10
            ka = eng.block_keys(tokens(n, lay, 41))
            kb = eng.block_keys(tokens(n, lay, 42))
            kva, kvb = rand_kv(lay, n, 41), rand_kv(lay, n, 42)
            await eng.put_kv(ka, kva.cuda())
            await eng.put_kv(kb, kvb.cuda())
            T = lay.block_tokens
            mixed = [k for pair in zip(ka, kb) for k in pair]
            want = torch.cat([torch.cat([kva[:, :, j * T:(j + 1) * T], kvb[:, :, j * T:(j + 1) * T]],
                                        dim=2) for j in range(n)], dim=2)
            before = copier.counters.batch_calls
            zc_before = copier.counters.by_method.get("zerocopy", 0)
            assert same_bits(await eng.get_kv(mixed, device="cuda"), want)
            for i in range(lay.num_layers):
                assert same_bits(await eng.get_kv(mixed, layer=i, device="cuda"), want[i])
            batched = copier.counters.batch_calls - before
            if mode == "off":
                assert batched == 0
                if copier.have_triton:   # 40 copies a layer > ZEROCOPY_MAX_CALLS: the kernel
                    zc = copier.counters.by_method.get("zerocopy", 0) - zc_before
                    assert zc >= lay.num_layers, copier.describe()
            else:
                assert batched >= 1 + lay.num_layers, copier.describe()
                assert copier.describe()["batch"] == mode
            # into the region: a layer-streamed put (``all`` batches its evenly spaced blocks
            # too), read back by the CPU
            kc = eng.block_keys(tokens(2 * n, lay, 43))
            kvc = rand_kv(lay, 2 * n, 43)
            before = copier.counters.batch_calls
            for i in range(lay.num_layers):
                await eng.put_kv(kc, kvc[i].cuda(), layer=i)
            assert same_bits(await eng.get_kv(kc), kvc)
            if mode == "all":
                assert copier.counters.batch_calls - before == lay.num_layers
    asyncio.run(main())


def test_the_zero_copy_kernel_is_compiled_when_the_copier_is_made(region_path):
    """``cuda_setup().copier(dev)`` compiles the zero-copy kernel for the layout's rows (else
    the first scattered put compiles it: 1.1-2.2 s inside one region-cache request on the H100,
    bench/results/gpu-20261206-s40); a zero-copy put after it is exact and compiles nothing."""
    lay = layout()

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            dev = torch.device("cuda", torch.cuda.current_device())
            copier = eng.cuda_setup(method="zerocopy").copier(dev)
            if not copier.have_triton:
                pytest.skip(f"no zero-copy path here: {copier.triton_reason}")
            assert set(copier.zerocopy_warm_s) == {lay.half_layer_bytes}
            warmed = dict(copier.zerocopy_warm_s)
            n = 6
            keys = eng.block_keys(tokens(n, lay, 11))
            kv = rand_kv(lay, n, 12)
            assert await eng.put_kv(keys, kv.cuda()) == n
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
            st = eng.stats()["cuda"]["devices"][str(dev)]
            assert st["by_method"].get("zerocopy", 0) > 0, st
            assert copier.zerocopy_warm_s == warmed
            assert st["zerocopy_warm_s"] == {str(lay.half_layer_bytes): round(
                warmed[lay.half_layer_bytes], 3)}
    asyncio.run(main())
