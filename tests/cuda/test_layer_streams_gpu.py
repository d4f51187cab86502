"""Layer streams on a real device (``cuda/layerstream.py``): a request's later layers take the
short path, bit-exact, and decline to the whole path whenever what the first layer established
no longer holds (another tensor form, split reservations, blocks that moved).

Sync tests around asyncio.run. Skipped without CUDA (conftest); run on the device with
``bench/gpu_suite.sh``.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

import tract_async as tract
from tract_async.errors import BlockEvicted, TensorMismatch
from tests.support.cuda_util import layout, rand_kv, same_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cfg(path: str, lay: tract.KVLayout, **kw) -> tract.EngineConfig:
    return tract.EngineConfig(region=path, region_bytes=256 << 20, create=True, node_id=0,
                              layout=lay, namespace="gpu-streams", **kw)


def tokens(n: int, lay: tract.KVLayout, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 50000 for i in range(n * lay.block_tokens)]


def streams(eng: tract.Engine) -> dict:
    return eng.stats()["cuda"]["layer_streams"]


async def stream_round(eng: tract.Engine, keys: list[bytes], kv: torch.Tensor,
                       out: torch.Tensor) -> None:
    for i in range(kv.shape[0]):
        await (await eng.start_put_kv(keys, kv[i], layer=i))
    for i in range(kv.shape[0]):
        await (await eng.start_get_kv(keys, out=out[i], layer=i))


@pytest.mark.parametrize("n", [1, 5, 40])
def test_later_layers_take_the_stream_and_are_exact(region_path, n):
    lay = layout()

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            keys = eng.block_keys(tokens(n, lay, n))
            kv = rand_kv(lay, n, n)
            out = torch.zeros_like(kv)
            await stream_round(eng, keys, kv, out)
            assert same_bits(out, kv)
            st = streams(eng)
            assert st["on"] is True
            # layers 1..L-1 of the put and of the get: every later layer, none declined
            assert st["used"] == 2 * (lay.num_layers - 1) and st["declined"] == 0, st
            # a new key list of the same content finds the stream too (found by content)
            out2 = torch.zeros_like(kv)
            for i in range(lay.num_layers):
                await (await eng.start_get_kv(list(keys), out=out2[i], layer=i))
            assert same_bits(out2, kv)
            assert eng.stats()["cuda"]["outstanding"] == 0
    asyncio.run(main())


def test_streams_off_take_the_whole_path(region_path, monkeypatch):
    monkeypatch.setenv("TRACT_CUDA_LAYER_STREAMS", "0")
    lay = layout()

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            keys = eng.block_keys(tokens(5, lay, 3))
            kv = rand_kv(lay, 5, 3)
            out = torch.zeros_like(kv)
            await stream_round(eng, keys, kv, out)
            assert same_bits(out, kv)
            assert streams(eng) == {"on": False, "used": 0, "declined": 0}
    asyncio.run(main())


def test_a_stream_declines_another_tensor_form_and_the_whole_path_decides(region_path):
    lay = layout()

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 5
            keys = eng.block_keys(tokens(n, lay, 4))
            kv = rand_kv(lay, n, 4)
            await (await eng.start_put_kv(keys, kv[0], layer=0))
            with pytest.raises(TensorMismatch):              # one block short
                await eng.start_put_kv(keys, kv[1][:, :16], layer=1)
            with pytest.raises(TensorMismatch):              # no such layer
                await eng.start_put_kv(keys, kv[1], layer=lay.num_layers)
            # a non-contiguous tensor of the right shape: the whole path copies it
            odd = kv[1].transpose(1, 2).contiguous().transpose(1, 2)
            assert not odd.is_contiguous()
            await (await eng.start_put_kv(keys, odd, layer=1))
            assert streams(eng)["declined"] == 3 and streams(eng)["used"] == 0
            for i in range(2, lay.num_layers):
                await (await eng.start_put_kv(keys, kv[i], layer=i))
            assert streams(eng)["used"] == lay.num_layers - 2
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
    asyncio.run(main())


def test_a_put_stream_declines_split_reservations(region_path):
    """A put of some of the keys splits the request's reservations: the stream's batch is no
    longer whole, so its later layers go through the whole path (key by key), still exact."""
    lay = layout()

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 12
            keys = eng.block_keys(tokens(n, lay, 5))
            kv = rand_kv(lay, n, 5)
            T = lay.block_tokens
            await (await eng.start_put_kv(keys, kv[0], layer=0))
            # layer 1 of the first three blocks alone: splits the batch
            await (await eng.start_put_kv(keys[:3], kv[1][:, :3 * T].contiguous(), layer=1))
            await (await eng.start_put_kv(keys, kv[1], layer=1))   # declined: split
            assert streams(eng)["declined"] == 1 and streams(eng)["used"] == 0
            for i in range(2, lay.num_layers):
                await (await eng.start_put_kv(keys, kv[i], layer=i))
            assert eng.lookup(keys) == n
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
    asyncio.run(main())


def test_a_get_stream_never_hands_over_bytes_of_blocks_that_changed(region_path):
    """Transfer mode: the blocks a get stream was made for are consumed and put again (new
    bytes, maybe other slots). A later layer's get by the stream gives the new bytes or
    BlockEvicted (a miss), never the old ones; the next attempt reads the new bytes."""
    lay = layout()

    async def main():
        async with tract.Engine.open(cfg(region_path, lay, mode="transfer")) as eng:
            n = 5
            keys = eng.block_keys(tokens(n, lay, 6))
            kv, kv2 = rand_kv(lay, n, 6), rand_kv(lay, n, 7)
            await eng.put_kv(keys, kv)
            out = torch.zeros_like(kv)
            await (await eng.start_get_kv(keys, out=out[0], layer=0))   # the stream
            assert same_bits(out[0], kv[0])
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)  # consumed
            assert eng.lookup(keys) == 0
            await eng.put_kv(keys, kv2)
            for i in range(1, lay.num_layers):
                try:
                    await (await eng.start_get_kv(keys, out=out[i], layer=i))
                except BlockEvicted:
                    await (await eng.start_get_kv(keys, out=out[i], layer=i))
                assert same_bits(out[i], kv2[i]), i
    asyncio.run(main())


def test_a_later_layer_whose_enqueue_fails_abandons_the_request_as_the_whole_path_does(
        region_path):
    """The stream's enqueue raises (a ``ready`` that is neither an event nor a stream): the
    request's reservations are abandoned, so the keys can be stored again from scratch."""
    lay = layout()

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 5
            keys = eng.block_keys(tokens(n, lay, 8))
            kv = rand_kv(lay, n, 8)
            await (await eng.start_put_kv(keys, kv[0], layer=0))
            with pytest.raises(Exception):
                await eng.start_put_kv(keys, kv[1], layer=1, ready="not an event")
            assert streams(eng)["used"] == 0
            assert eng.lookup(keys) == 0
            assert await eng.put_kv(keys, kv) == n              # all new again
            assert same_bits(await eng.get_kv(keys, device="cuda"), kv)
    asyncio.run(main())


def region_stats(eng: tract.Engine):
    return eng._store.blocks.stats


def test_layers_a_validated_read_saw_in_need_no_look_and_stay_exact(region_path):
    """cuda/layerstream.py, "Seen layers": a request read after its prefill finished looks at
    the entries on its first layer only; the next request of the same keys looks again on its
    first layer (a layer asked again), then not."""
    lay = layout(6)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 7
            keys = eng.block_keys(tokens(n, lay, 11))
            kv = rand_kv(lay, n, 11)
            await eng.put_kv(keys, kv)
            st = region_stats(eng)
            for rnd in range(2):
                out = torch.zeros_like(kv)
                seen0, known0 = st.seen_layer_reads, st.known_slot_reads
                for i in range(lay.num_layers):
                    await (await eng.start_get_kv(keys, out=out[i], layer=i))
                assert same_bits(out, kv), rnd
                # round 0: layer 0 makes the stream (the whole path); round 1: layer 0 is
                # asked again, so it looks (known slots); every later layer: no look
                assert st.seen_layer_reads - seen0 == lay.num_layers - 1, rnd
                assert st.known_slot_reads - known0 == rnd, rnd
    asyncio.run(main())


def test_a_layer_not_yet_seen_in_is_looked_at_while_the_producer_streams(region_path):
    """A decode stream that reads each layer as it lands: the first read saw only layer 0 in,
    so layer 1 is looked at (then found in), and layers are skipped only once a validated
    read saw them in; every layer exact."""
    lay = layout(6)

    async def main():
        async with tract.Engine.open(cfg(region_path, lay)) as eng:
            n = 9
            keys = eng.block_keys(tokens(n, lay, 12))
            kv = rand_kv(lay, n, 12)
            out = torch.zeros_like(kv)
            st = region_stats(eng)
            await (await eng.start_put_kv(keys, kv[0], layer=0))
            await (await eng.start_get_kv(keys, out=out[0], layer=0))   # the stream
            seen0, known0 = st.seen_layer_reads, st.known_slot_reads
            await (await eng.start_put_kv(keys, kv[1], layer=1))
            await (await eng.start_get_kv(keys, out=out[1], layer=1))
            assert (st.seen_layer_reads - seen0, st.known_slot_reads - known0) == (0, 1)
            for i in range(2, lay.num_layers):
                await (await eng.start_put_kv(keys, kv[i], layer=i))
            for i in range(2, lay.num_layers):
                await (await eng.start_get_kv(keys, out=out[i], layer=i))
            # layer 2 learned from layer 1's read (layers 0-1 in): looked; it saw them all
            assert (st.seen_layer_reads - seen0, st.known_slot_reads - known0) == (
                lay.num_layers - 3, 2)
            assert same_bits(out, kv)
    asyncio.run(main())
