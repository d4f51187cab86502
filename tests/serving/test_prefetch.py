"""LayerStream: the decode worker's reads of every layer as it is published."""
from __future__ import annotations

import asyncio

import pytest

from tract_async.serving.prefetch import LayerStream


# -- LayerStream: one reader walking every layer as it is published ---------------------------



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


async def test_stream_start_reads_before_anyone_asks_and_on_ask_names_each_layer() -> None:
    """start() begins the walk at once (the decode worker reads while it waits for the compute
    slot); with ``ahead`` it stops ``ahead`` layers in until asked; on_ask sees each request."""
    began: list[int] = []
    asked: list[int] = []

    async def read(i: int) -> int:
        began.append(i)
        return i

    stream = LayerStream(read, 6, ahead=2, on_ask=asked.append)
    stream.start()
    stream.start()                            # idempotent: one reader
    for _ in range(5):
        await asyncio.sleep(0)
    assert began == [0, 1] and asked == []
    assert await stream(0) == 0
    for _ in range(5):
        await asyncio.sleep(0)
    assert began == [0, 1, 2] and asked == [0]
    assert [await stream(i) for i in range(1, 6)] == [1, 2, 3, 4, 5]
    assert asked == list(range(6))
    await stream.aclose()
    unbounded: list[int] = []

    async def read_all(i: int) -> int:
        unbounded.append(i)
        return i

    s2 = LayerStream(read_all, 4)
    s2.start()
    for _ in range(10):
        await asyncio.sleep(0)
    assert unbounded == [0, 1, 2, 3]
    await s2.aclose()


async def test_settled_and_all_read_wait_for_every_layer_even_a_failed_one() -> None:
    gate = asyncio.Event()

    async def read(layer: int) -> int:
        if layer == 2:
            await gate.wait()
            raise RuntimeError("layer 2 is gone")
        return layer

    stream = LayerStream(read, 4)
    assert not stream.settled
    waiter = asyncio.create_task(stream.all_read())      # starts the reader
    await asyncio.sleep(0.01)
    assert not stream.settled and not waiter.done()       # layer 2 is still being read
    gate.set()
    await asyncio.wait_for(waiter, 5)                     # never raises a layer's error
    assert stream.settled
    assert await stream(1) == 1
    with pytest.raises(RuntimeError, match="layer 2 is gone"):
        await stream(2)
    with pytest.raises(RuntimeError, match="was not read"):
        await stream(3)
    await stream.aclose()
