"""HTTP mode (the baseline): KV travels over the NIXL-style agent, as vLLM's NixlConnector does.

The prefill worker registers one KV pool with its agent at start (as NIXL agents register a
worker's whole KV cache once, so peers fetch metadata once, not per request). A request's KV is
written into a span of that pool; the reply to the router names the span by a descriptor. The
decode worker READs the span into a buffer of its own and, as the agent does for every READ with a
notification, tells the prefill agent once the last byte has landed (sent after the READ
returns, off the critical path); that notification frees the span. A span nobody READs is freed after ``hold_s`` (longer than any decode deadline, so
a READ still in flight cannot see its bytes reused: docs/design.md invariant 7).
"""
from __future__ import annotations

import asyncio
import bisect
from typing import Any

import torch

from tract_async.serving.errors import KVPoolFull, KVUnavailable
from tract_async.serving.protocol import KVSource
from tract_async.serving.service import TaskOwner

ALIGN_BYTES = 64
POOL_NAME = "kv-pool"


class SpanPool:
    """First-fit allocator of byte spans in a fixed pool, with coalescing frees.

    ``alloc`` waits (up to its deadline) for frees when the pool is full. Not thread-safe: used
    from the event loop only.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]   # sorted (offset, length)
        self._used: dict[int, int] = {}
        self._changed = asyncio.Condition()

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def alloc_nowait(self, nbytes: int) -> int | None:
        need = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self._used[off] = need
                return off
        return None

    async def alloc(self, nbytes: int, *, timeout: float) -> int:
        """Raises KVPoolFull: larger than the pool, or no room within ``timeout`` seconds."""
        if nbytes > self.nbytes:
            raise KVPoolFull(f"{nbytes} bytes of KV exceed the whole pool ({self.nbytes} bytes); "
                             f"raise --kv-pool-bytes")
        try:
            async with asyncio.timeout(timeout), self._changed:
                while (off := self.alloc_nowait(nbytes)) is None:
                    await self._changed.wait()
                return off
        except TimeoutError:
            raise KVPoolFull(f"no {nbytes}-byte span free in the KV pool within {timeout} s "
                             f"({self.used_bytes} of {self.nbytes} bytes held by unread KV)") from None

    async def free(self, offset: int) -> None:
        need = self._used.pop(offset)
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, need))
        # coalesce with the right, then the left neighbour
        if i + 1 < len(self._free) and offset + need == self._free[i + 1][0]:
            self._free[i] = (offset, need + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])
        async with self._changed:
            self._changed.notify_all()


class KVExporter:
    """Prefill side: a pool registered with the agent; spans of request KV that peers READ."""

    def __init__(self, agent: Any, pool_bytes: int, *, hold_s: float, tasks: TaskOwner) -> None:
        self.agent = agent
        self.pool = torch.zeros(pool_bytes, dtype=torch.uint8)
        self.info = agent.register_memory(self.pool, name=POOL_NAME, writable=False)
        self.spans = SpanPool(pool_bytes)
        self.hold_s = hold_s
        self.tasks = tasks
        self.released = 0
        self.expired = 0

    async def reserve(self, shape: tuple[int, ...], dtype: torch.dtype, *, timeout: float) -> tuple[int, torch.Tensor]:
        """A span shaped as a KV tensor: ``(offset, view)``. Raises KVPoolFull."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for d in shape:
            nbytes *= d
        off = await self.spans.alloc(max(nbytes, 1), timeout=timeout)
        view = self.pool[off:off + nbytes].view(dtype).view(shape)
        return off, view

    async def discard(self, offset: int) -> None:
        """Give a span back that was never published (the prefill failed)."""
        await self.spans.free(offset)

    def publish(self, request_id: str, offset: int, nbytes: int, tokens: int, consumer: str,
                agent_url: str) -> KVSource:
        """Describe the span for the consumer and free it when the consumer's READ notification
        arrives (or after ``hold_s``)."""
        self.tasks.spawn(self._release_after_read(request_id, offset, consumer),
                         name=f"kv-release-{request_id}")
        return KVSource(agent=self.agent.name, agent_url=agent_url,
                        desc=self.info.desc(offset, nbytes), tokens=tokens)

    async def _release_after_read(self, request_id: str, offset: int, consumer: str) -> None:
        from tract_async.transport.errors import AgentClosed, NotificationTimeout
        try:
            await self.agent.wait_notif(consumer, request_id.encode(), timeout=self.hold_s)
            self.released += 1
        except (NotificationTimeout, AgentClosed):
            self.expired += 1
        finally:
            await asyncio.shield(self.spans.free(offset))


class KVImporter:
    """Decode side: READ a request's KV from the prefill agent into a local tensor."""

    def __init__(self, agent: Any, *, tasks: TaskOwner, notif_timeout_s: float = 30.0) -> None:
        self.agent = agent
        self.tasks = tasks
        self.notif_timeout_s = notif_timeout_s
        self._known: dict[str, asyncio.Task[str]] = {}

    async def _peer(self, src: KVSource, timeout: float) -> str:
        task = self._known.get(src.agent)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.ensure_future(self.agent.fetch_remote_metadata(src.agent_url, timeout=timeout))
            self._known[src.agent] = task
        return await asyncio.shield(task)

    async def read(self, request_id: str, src: KVSource, shape: tuple[int, ...], dtype: torch.dtype,
                   *, timeout: float) -> torch.Tensor:
        """The KV the source names, as a new CPU tensor of ``shape``.

        Raises KVUnavailable (wrong size, peer unreachable, transfer failed or timed out).
        """
        from tract_async.errors import TractError
        from tract_async.transport.descs import XferDescList
        dst = torch.empty(shape, dtype=dtype)
        nbytes = dst.numel() * dst.element_size()
        if nbytes != src.desc[1]:
            raise KVUnavailable(f"request {request_id}: the source holds {src.desc[1]} bytes, "
                                f"this worker expects {nbytes} for shape {shape}")
        name = f"rx-{request_id}"
        try:
            peer = await self._peer(src, timeout)
            self.agent.register_memory(dst, name=name)
            try:
                handle = self.agent.initialize_xfer(
                    "READ", self.agent.get_xfer_descs(dst), XferDescList([src.desc], "DRAM"), peer)
                try:
                    await self.agent.transfer(handle, timeout=timeout)
                finally:
                    handle.release()
            finally:
                self.agent.deregister_memory(name)
        except TractError as exc:
            raise KVUnavailable(f"request {request_id}: HTTP READ of {nbytes} bytes from "
                                f"{src.agent} failed: {type(exc).__name__}: {exc}") from exc
        # The bytes are here: release the span, off the critical path (the agent would otherwise
        # send the READ's notification before transfer() returns, one more round trip).
        self.tasks.spawn(self._notify(peer, request_id), name=f"kv-read-notif-{request_id}")
        return dst

    async def _notify(self, peer: str, request_id: str) -> None:
        from tract_async.errors import TractError
        try:
            await self.agent.send_notif(peer, request_id.encode(), timeout=self.notif_timeout_s)
        except TractError:
            pass  # the span expires at the producer after its hold time
