"""LayerReads: the decode worker's reads ahead of the layer it needs."""
from __future__ import annotations

import asyncio

import pytest

from tract_async.serving.prefetch import LayerReads


async def test_reads_ahead_in_order_and_returns_each_layer() -> None:
    began: list[int] = []
    gates = {i: asyncio.Event() for i in range(6)}

    async def read(i: int) -> int:
        began.append(i)
        await gates[i].wait()
        return i * 10

    reads = LayerReads(read, 6, depth=2)
    first = asyncio.ensure_future(reads(0))
    for _ in range(3):                           # the call runs, then the reads start
        await asyncio.sleep(0)
    assert began == [0, 1, 2]                    # layer 0 plus two ahead, before 0 lands
    for g in gates.values():
        g.set()
    assert await first == 0
    assert [await reads(i) for i in range(1, 6)] == [10, 20, 30, 40, 50]
    assert began == list(range(6))
    with pytest.raises(RuntimeError):
        await reads(3)                           # a layer is read once
    with pytest.raises(IndexError):
        await reads(6)
    await reads.aclose()


async def test_aclose_cancels_reads_nobody_awaited_and_drops_their_errors() -> None:
    cancelled: list[int] = []

    async def read(i: int) -> int:
        if i == 2:
            raise OSError("a read ahead failed")   # never awaited: dropped
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    reads = LayerReads(read, 8, depth=2)
    t = asyncio.ensure_future(reads(0))
    await asyncio.sleep(0.01)
    t.cancel()                                   # the caller's layer timeout, say
    with pytest.raises(asyncio.CancelledError):
        await t
    await reads.aclose()
    assert sorted(cancelled) == [0, 1]


async def test_an_awaited_read_raises_its_error() -> None:
    async def read(i: int) -> int:
        if i == 1:
            raise KeyError(i)
        return i

    reads = LayerReads(read, 3, depth=1)
    assert await reads(0) == 0
    with pytest.raises(KeyError):
        await reads(1)
    await reads.aclose()


# -- LayerStream: one reader walking every layer as it is published ---------------------------

from tract_async.serving.prefetch import LayerStream  # noqa: E402


async def test_stream_reads_every_layer_in_order_with_one_reader_at_a_time() -> None:
    """The reader runs ahead of the consumer as far as layers can be read (here: all, as each
    read is released), never two reads at once, and each layer is returned once."""
    began: list[int] = []
    active = [0]
    gates = {i: asyncio.Event() for i in range(6)}

    async def read(i: int) -> int:
        began.append(i)
        active[0] += 1
        assert active[0] == 1, "two reads at once"
        await gates[i].wait()
        active[0] -= 1
        return i * 10

    stream = LayerStream(read, 6)
    first = asyncio.ensure_future(stream(0))
    for _ in range(3):
        await asyncio.sleep(0)
    assert began == [0]                       # one reader, waiting on layer 0
    for i in range(6):                        # layers published one by one, nobody asking
        gates[i].set()
        for _ in range(3):
            await asyncio.sleep(0)
    assert began == list(range(6)), "every layer read as soon as it could be"
    assert await first == 0
    assert [await stream(i) for i in range(1, 6)] == [10, 20, 30, 40, 50]
    with pytest.raises(RuntimeError):
        await stream(3)
    with pytest.raises(IndexError):
        await stream(6)
    await stream.aclose()


async def test_stream_ahead_bounds_how_far_the_reader_runs() -> None:
    began: list[int] = []

    async def read(i: int) -> int:
        began.append(i)
        return i

    stream = LayerStream(read, 8, ahead=2)
    assert await stream(0) == 0
    for _ in range(5):
        await asyncio.sleep(0)
    assert began == [0, 1, 2]
    assert await stream(3) == 3
    for _ in range(5):
        await asyncio.sleep(0)
    assert began == [0, 1, 2, 3, 4, 5]
    await stream.aclose()


async def test_stream_error_reaches_its_layer_and_later_layers_say_why() -> None:
    async def read(i: int) -> int:
        if i == 2:
            raise KeyError(i)
        return i

    stream = LayerStream(read, 5)
    assert await stream(0) == 0
    assert await stream(1) == 1
    with pytest.raises(KeyError):
        await stream(2)
    with pytest.raises(RuntimeError, match="layer 2's read failed"):
        await stream(3)
    await stream.aclose()


async def test_stream_aclose_cancels_the_reader_and_a_waiting_consumer_is_released() -> None:
    cancelled: list[int] = []

    async def read(i: int) -> int:
        if i == 0:
            return 0
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    stream = LayerStream(read, 4)
    assert await stream(0) == 0
    waiting = asyncio.ensure_future(stream(1))
    await asyncio.sleep(0.01)
    await stream.aclose()
    assert cancelled == [1]
    with pytest.raises(asyncio.CancelledError):
        await waiting
