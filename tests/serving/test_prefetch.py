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
