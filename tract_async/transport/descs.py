"""Registered memory and descriptor lists of the HTTP transport (NIXL's nixlRegDList / nixlXferDList).

A descriptor is ``(addr, nbytes, dev_id)``: a byte range in the address space of the agent that
registered it, as in NIXL. Remote peers learn the registered ranges from the agent metadata and
name bytes by their address there; the owning agent bounds-checks every descriptor against its
registry before touching a byte, so an address is only ever a *name* for registered bytes, never
dereferenced blindly.

What can be registered, and how its bytes are reached:

* a contiguous CPU torch tensor or C-contiguous numpy array: through a memoryview of its storage;
* a writable buffer (``mmap``, ``bytearray``, ``memoryview``): through that buffer;
* a raw ``(address, nbytes)`` range, e.g. inside a shared mapping another layer owns: through a
  ctypes view. Warning: the caller keeps that mapping alive until ``deregister``;
* a contiguous CUDA tensor: through a pinned host staging buffer (``StagingPool``), chunk by chunk.

The registry keeps a reference to every registered object, so a registered tensor cannot be freed
under a transfer, and deregistering a range that a transfer still uses raises TransferInProgress
(invariant 7: no reuse under a live transfer).
"""
from __future__ import annotations

import asyncio
import bisect
import ctypes
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tract_async.transport.errors import (
    DescriptorOutOfRange,
    InvalidDescriptors,
    MemoryAlreadyRegistered,
    MemoryNotRegistered,
    TransferInProgress,
)

MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, kw_only=True)
class RegionInfo:
    """One registered range, as the metadata publishes it (no local object, just numbers)."""

    name: str
    addr: int
    nbytes: int
    mem_type: str
    dev_id: int
    writable: bool

    def desc(self, offset_bytes: int = 0, nbytes: int | None = None) -> tuple[int, int, int]:
        """The descriptor of ``nbytes`` at ``offset_bytes`` into this range (whole range by default).

        Raises DescriptorOutOfRange if the slice leaves the range.
        """
        n = self.nbytes - offset_bytes if nbytes is None else nbytes
        if offset_bytes < 0 or n <= 0 or offset_bytes + n > self.nbytes:
            raise DescriptorOutOfRange(
                f"slice [{offset_bytes}, +{n}) is outside region {self.name!r} of {self.nbytes} bytes")
        return (self.addr + offset_bytes, n, self.dev_id)


class XferDescList:
    """An ordered list of ``(addr, nbytes, dev_id)`` descriptors of one memory type.

    Rows live in an ``(N, 3)`` uint64 array: cheap to build for thousands of KV blocks and cheap
    to put on the wire. Built by ``Agent.get_xfer_descs``; immutable after construction.
    """

    __slots__ = ("mem_type", "rows")

    def __init__(self, rows: Any, mem_type: str = "DRAM") -> None:
        """Raises InvalidDescriptors if rows is not N x 3 non-negative integers or mem_type is unknown."""
        if mem_type not in MEM_TYPES:
            raise InvalidDescriptors(f"mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
        try:
            arr = np.array(rows, dtype=np.int64).reshape(-1, 3) if len(rows) else np.zeros((0, 3), np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidDescriptors(f"descriptors must be (addr, nbytes, dev_id) integer triples: {e}") from e
        if len(arr) == 0:
            raise InvalidDescriptors("a descriptor list needs at least one descriptor")
        if (arr < 0).any() or (arr[:, 1] == 0).any():
            raise InvalidDescriptors("descriptor fields must be >= 0 and nbytes must be > 0")
        arr.setflags(write=False)
        self.rows = arr
        self.mem_type = mem_type

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterable[tuple[int, int, int]]:
        return (tuple(int(v) for v in row) for row in self.rows)  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"XferDescList({len(self)} descs, {self.total_bytes} bytes, {self.mem_type})"

    @property
    def total_bytes(self) -> int:
        return int(self.rows[:, 1].sum())

    def to_wire(self) -> list[list[int]]:
        return self.rows.tolist()


def _byte_view_of(obj: Any) -> tuple[str, int, int, int, Any]:
    """(mem_type, addr, nbytes, dev_id, accessor) of a registrable object; see the module docstring.

    Raises InvalidDescriptors for anything that cannot be registered (non-contiguous, empty,
    read-only buffers, unknown types).
    """
    torch = sys.modules.get("torch")   # an object is a tensor only where torch was imported
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_contiguous():
            raise InvalidDescriptors("register a contiguous tensor (call .contiguous() first)")
        nbytes = obj.numel() * obj.element_size()
        if nbytes == 0:
            raise InvalidDescriptors("cannot register an empty tensor")
        flat = obj.reshape(-1).view(torch.uint8)
        if obj.is_cuda:
            return "VRAM", obj.data_ptr(), nbytes, obj.get_device(), flat
        return "DRAM", obj.data_ptr(), nbytes, 0, memoryview(flat.numpy())
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous or obj.nbytes == 0:
            raise InvalidDescriptors("register a non-empty C-contiguous numpy array")
        if not obj.flags.writeable:
            raise InvalidDescriptors("register a writeable numpy array (WRITE needs to land somewhere)")
        return "DRAM", obj.ctypes.data, obj.nbytes, 0, memoryview(obj.reshape(-1).view(np.uint8))
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
        addr, nbytes = obj
        if addr <= 0 or nbytes <= 0:
            raise InvalidDescriptors(f"raw range needs addr > 0 and nbytes > 0, got {obj}")
        mv = memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")
        return "DRAM", addr, nbytes, 0, mv
    try:
        mv = memoryview(obj).cast("B")
    except TypeError as e:
        raise InvalidDescriptors(
            f"cannot register {type(obj).__name__}: pass a tensor, an ndarray, a writable buffer "
            "or an (address, nbytes) tuple") from e
    if mv.readonly or mv.nbytes == 0:
        raise InvalidDescriptors("register a non-empty writable buffer")
    addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data
    return "DRAM", addr, mv.nbytes, 0, mv


class StagingPool:
    """Pinned host buffers that CUDA spans copy through, a few at a time.

    Bounded on purpose: a transfer waits for a free buffer instead of allocating, so the host
    memory of the VRAM path is ``count * chunk_bytes`` however many transfers are in flight.
    """

    def __init__(self, chunk_bytes: int, count: int = 2) -> None:
        self.chunk_bytes = chunk_bytes
        self._count = count
        self._free: asyncio.Queue[Any] | None = None

    async def acquire(self) -> Any:
        import torch

        if self._free is None:
            self._free = asyncio.Queue()
            for _ in range(self._count):
                self._free.put_nowait(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True))
        return await self._free.get()

    def release(self, buf: Any) -> None:
        assert self._free is not None, "StagingPool.release without acquire"
        self._free.put_nowait(buf)


async def _cuda_wait(stream: Any) -> None:
    """Wait for work queued on ``stream`` without blocking the event loop (the sync runs in a thread)."""
    import torch

    ev = torch.cuda.Event()
    ev.record(stream)
    await asyncio.to_thread(ev.synchronize)


class Registered:
    """A registered range plus the object that owns its bytes and the way to reach them."""

    __slots__ = ("info", "keeper", "access", "users")

    def __init__(self, info: RegionInfo, keeper: Any, access: Any) -> None:
        self.info = info
        self.keeper = keeper   # keeps the tensor / array / mapping alive while registered
        self.access = access   # memoryview (DRAM) or flat uint8 CUDA tensor (VRAM)
        self.users = 0         # transfers currently reading or writing this range

    def span(self, addr: int, nbytes: int) -> Span:
        return Span(self, addr - self.info.addr, nbytes)


class Span:
    """``nbytes`` of one registered range at ``offset_bytes``: the unit a transfer reads or fills."""

    __slots__ = ("reg", "offset_bytes", "nbytes")

    def __init__(self, reg: Registered, offset_bytes: int, nbytes: int) -> None:
        self.reg = reg
        self.offset_bytes = offset_bytes
        self.nbytes = nbytes

    async def read_pieces(self, chunk_bytes: int, staging: StagingPool) -> AsyncIterator[memoryview]:
        """Yield the span's bytes in pieces of at most ``chunk_bytes`` without copying (DRAM).

        For VRAM each piece is a pinned staging buffer, valid only until the next iteration.
        """
        start, end = self.offset_bytes, self.offset_bytes + self.nbytes
        if self.reg.info.mem_type == "DRAM":
            mv: memoryview = self.reg.access
            for pos in range(start, end, chunk_bytes):
                yield mv[pos:min(pos + chunk_bytes, end)]
            return
        import torch

        buf = await staging.acquire()
        try:
            stream = torch.cuda.current_stream(self.reg.access.device)
            for pos in range(start, end, staging.chunk_bytes):
                n = min(staging.chunk_bytes, end - pos)
                buf[:n].copy_(self.reg.access[pos:pos + n], non_blocking=True)
                await _cuda_wait(stream)
                yield memoryview(buf.numpy())[:n]
        finally:
            staging.release(buf)

    def writer(self, staging: StagingPool) -> SpanWriter:
        return SpanWriter(self, staging)


class SpanWriter:
    """Fills a span in order from incoming pieces of any size; ``finish`` checks it is full."""

    __slots__ = ("span", "pos", "_staging", "_buf", "_buf_fill")

    def __init__(self, span: Span, staging: StagingPool) -> None:
        self.span = span
        self.pos = 0
        self._staging = staging
        self._buf: Any = None
        self._buf_fill = 0

    @property
    def remaining(self) -> int:
        # staged bytes count as written: they land on the device at the next flush
        return self.span.nbytes - self.pos - self._buf_fill

    async def write(self, data: memoryview | bytes) -> None:
        """Copy ``data`` (at most ``remaining`` bytes) to the next position of the span."""
        n = len(data)
        assert n <= self.remaining, "SpanWriter.write past the end of its span"
        reg = self.span.reg
        if reg.info.mem_type == "DRAM":
            base = self.span.offset_bytes + self.pos
            reg.access[base:base + n] = data
            self.pos += n
            return
        # VRAM: gather into the pinned buffer, flush to the device when it is full.
        if self._buf is None:
            self._buf = await self._staging.acquire()
        src = memoryview(data)
        while len(src):
            take = min(len(src), self._staging.chunk_bytes - self._buf_fill)
            memoryview(self._buf.numpy())[self._buf_fill:self._buf_fill + take] = src[:take]
            self._buf_fill += take
            src = src[take:]
            if self._buf_fill == self._staging.chunk_bytes:
                await self._flush()

    async def _flush(self) -> None:
        import torch

        reg = self.span.reg
        dst = self.span.offset_bytes + self.pos
        stream = torch.cuda.current_stream(reg.access.device)
        reg.access[dst:dst + self._buf_fill].copy_(self._buf[:self._buf_fill], non_blocking=True)
        await _cuda_wait(stream)
        self.pos += self._buf_fill
        self._buf_fill = 0

    async def finish(self) -> None:
        """Flush staged bytes and give back the staging buffer. Idempotent."""
        if self._buf is not None:
            try:
                if self._buf_fill:
                    await self._flush()
            finally:
                self._staging.release(self._buf)
                self._buf = None


class MemoryRegistry:
    """The agent's registered ranges, sorted by address for O(log n) descriptor checks."""

    def __init__(self) -> None:
        self._by_addr: list[int] = []
        self._regs: list[Registered] = []
        self._by_name: dict[str, Registered] = {}
        self._anon = 0

    def register(self, obj: Any, *, name: str | None = None, writable: bool = True) -> RegionInfo:
        """Register ``obj`` (see the module docstring for accepted types); returns its RegionInfo.

        Raises InvalidDescriptors (unregistrable object), MemoryAlreadyRegistered (overlap or
        name taken).
        """
        mem_type, addr, nbytes, dev_id, access = _byte_view_of(obj)
        if name is None:
            self._anon += 1
            name = f"mem{self._anon}"
        if name in self._by_name:
            raise MemoryAlreadyRegistered(f"a region named {name!r} is already registered")
        i = bisect.bisect_left(self._by_addr, addr)
        for j in (i - 1, i):
            if 0 <= j < len(self._regs):
                o = self._regs[j].info
                if o.dev_id == dev_id and o.mem_type == mem_type and addr < o.addr + o.nbytes and o.addr < addr + nbytes:
                    raise MemoryAlreadyRegistered(
                        f"[{addr:#x}, +{nbytes}) overlaps registered region {o.name!r} [{o.addr:#x}, +{o.nbytes})")
        info = RegionInfo(name=name, addr=addr, nbytes=nbytes, mem_type=mem_type, dev_id=dev_id, writable=writable)
        reg = Registered(info, obj, access)
        self._by_addr.insert(i, addr)
        self._regs.insert(i, reg)
        self._by_name[name] = reg
        return info

    def deregister(self, name: str) -> None:
        """Forget the range registered under ``name``.

        Raises MemoryNotRegistered (no such name), TransferInProgress (a transfer still uses it).
        """
        reg = self._by_name.get(name)
        if reg is None:
            raise MemoryNotRegistered(f"no region named {name!r} is registered")
        if reg.users:
            raise TransferInProgress(f"region {name!r} is in use by {reg.users} transfer(s); wait for them first")
        del self._by_name[name]
        i = self._regs.index(reg)
        del self._regs[i]
        del self._by_addr[i]

    def view(self, name: str) -> memoryview:
        """The bytes of a registered DRAM range (for checks; transfers go through spans).

        Raises MemoryNotRegistered (unknown name), InvalidDescriptors (a VRAM range).
        """
        self.get(name)
        reg = self._by_name[name]
        if reg.info.mem_type != "DRAM":
            raise InvalidDescriptors(f"region {name!r} is {reg.info.mem_type}; only DRAM has a host view")
        return reg.access

    def in_use(self, name: str) -> bool:
        """Does a transfer still hold the range registered under ``name``?
        Raises MemoryNotRegistered."""
        reg = self._by_name.get(name)
        if reg is None:
            raise MemoryNotRegistered(f"no region named {name!r} is registered")
        return reg.users > 0

    def infos(self) -> list[RegionInfo]:
        return [r.info for r in self._regs]

    def get(self, name: str) -> RegionInfo:
        """Raises MemoryNotRegistered if no region has that name."""
        reg = self._by_name.get(name)
        if reg is None:
            raise MemoryNotRegistered(f"no region named {name!r} is registered")
        return reg.info

    def spans(self, rows: Sequence[Sequence[int]], mem_type: str, *, for_write: bool,
              local: bool) -> list[Span]:
        """Resolve descriptors to spans, checking every byte lies inside one registered range.

        ``local`` picks the exception: a caller's own bad descriptor is MemoryNotRegistered, a
        peer's is DescriptorOutOfRange (the server answers it with 'desc_out_of_range').
        """
        err = MemoryNotRegistered if local else DescriptorOutOfRange
        out: list[Span] = []
        for k, row in enumerate(rows):
            addr, nbytes, dev_id = (int(v) for v in row)
            i = bisect.bisect_right(self._by_addr, addr) - 1
            # Ranges of different devices may share addresses; scan the (few) candidates at addr.
            while i >= 0:
                info = self._regs[i].info
                if info.mem_type == mem_type and info.dev_id == dev_id:
                    break
                i -= 1
            if i < 0 or nbytes <= 0 or addr + nbytes > info.addr + info.nbytes or addr < info.addr:
                raise err(f"descriptor {k} [{addr:#x}, +{nbytes}) dev {dev_id} {mem_type} is not inside registered memory")
            if for_write and not info.writable:
                raise err(f"descriptor {k} targets region {info.name!r}, registered read-only")
            out.append(self._regs[i].span(addr, nbytes))
        return out
