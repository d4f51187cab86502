"""The NIXL path of the Engine: the HTTP store's directory and validation, NIXL's data path.

``EngineConfig(region=None, peers=[...], transport="nixl")`` (or a region whose fallback is
configured with ``transport="nixl"``) runs the same ``put_kv`` / ``get_kv`` / ``lookup`` and
layer streaming as the HTTP transport, with the bytes of remote gets moving through NIXL (UCX)
instead of HTTP. Everything else is the HTTP store's, reused, not rewritten (``stores/http.py``): the
block pool, the directory fed by acknowledged, authenticated announcements over the aiohttp
agent, the hello that peers exchange, the post-read version check that makes a stale entry a
miss and never wrong bytes, transfer-only consumption, LRU, expiry. What this subclass changes:

* **Peering.** The engine runs a ``NixlAgent`` beside its HTTP agent; the block pool is
  registered with both. The (signed) hello and its reply carry the NIXL metadata, so NIXL's
  unauthenticated metadata travels over the authenticated channel. A peer whose hello has no
  NIXL metadata (an engine on the HTTP transport) is read over HTTP: the transport is chosen per
  peer, and mixed racks interoperate (an HTTP engine reads a NIXL engine's pool over HTTP).
* **Remote gets.** One NIXL READ per peer of a get, into a staging buffer from a small cache of
  registered buffers (registering costs 17-30 µs here, more than a 4 KiB READ over TCP), then the
  same check and copy-out as over HTTP. A READ that times out leaves its buffer quarantined
  (``nixl_agent``: no reuse while bytes might still land). The staging in use at once is
  bounded (``EngineConfig.nixl_staging_bytes``; one READ is always let through, whatever its
  size): further READs wait for room, in order, within their timeout. Unbounded, a decode
  worker under load staged every arriving request's whole KV at once in GPU memory and ran out
  of it (1 GiB a request on the H100 host, ``bench/results/gpu-20261207-s51``).
* **Layer readiness.** A put of one layer also sends its announce ops to every NIXL peer as a
  NIXL notification, before the HTTP announcement that the put waits for. The receiver merges
  them only into entries that already exist at the same slot and version
  (``Directory.add_layers``): the notification is a fast, unacknowledged hint that can never
  create, resurrect or rewind an entry; the HTTP announcement stays the source of truth. A
  consumer waiting for layer i of a block it already knows wakes on whichever arrives first.
* **Progress.** Over TCP the holder of the pool must progress its NIXL worker to serve READs
  (``nixl_agent``). It polls on every loop iteration after it published blocks and after it
  served a check (``keep_hot``: readers are likely to follow), otherwise every millisecond.
* **GPU pools.** ``nixl_pool_device="cuda"`` keeps the pool in GPU memory, registered as VRAM:
  CUDA tensors are put and got directly, and peers READ GPU to GPU through UCX (cuda_copy over
  TCP; GPUDirect RDMA where UCX has it). Run on the H100 host (``test_gpu_pool_round_trip``,
  and the serving stack's nixl rows: ``bench/results/gpu-20261206-s40``).
"""
from __future__ import annotations

import asyncio
import base64
import bisect
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from ..arrays import require_torch
from ..config import EngineConfig
from .directory import ops_list, parse_ops
from .http import POOL_NAME, HttpStats, HttpStore
from ..transport import errors as TE
from ..transport.descs import RegionInfo
from ..transport.nixl_agent import NixlAgent

torch = require_torch('transport="nixl"')

NOTIF_LAYERS = b"tract-kv1 L"     # prefix of a layer-readiness notification (then orjson ops)
MAX_NOTIF_OPS = 1024              # larger puts are announced over HTTP only
STAGING_CACHE_BYTES = 256 << 20   # registered staging kept for reuse


@dataclasses.dataclass
class NixlStats(HttpStats):
    """The HTTP store's counters plus NIXL's."""
    reads_nixl: int = 0              # remote gets served by NIXL READs
    reads_http: int = 0              # ... by HTTP (peers without NIXL)
    layer_notifs_sent: int = 0
    layer_notifs_applied: int = 0    # entries that gained layers from a notification first
    notifs_refused: int = 0          # malformed or unknown notifications (dropped)


def _size_class(nbytes: int) -> int:
    """The staging buffer that holds ``nbytes``: a power of two, at least 4 KiB."""
    return 1 << max(12, (nbytes - 1).bit_length())


class _Staging:
    """Registered staging buffers for NIXL READs, reused by size (power-of-two classes), and the
    bound on the bytes of them in use at once (``room`` / ``release``: first come, first
    served; a READ alone is always let through).

    A buffer whose READ was abandoned stays registered and in use (quarantined by the agent);
    ``give`` never hands it out again and forgets it (the agent frees it when it closes). Its
    room is released all the same: a bound that quarantined buffers could exhaust would stop
    every later READ."""

    def __init__(self, agent: NixlAgent, device: torch.device, limit_bytes: int,
                 inflight_bytes: int) -> None:
        self.agent = agent
        self.device = device
        self.limit_bytes = limit_bytes
        self.inflight_bytes = inflight_bytes
        self.in_use = 0
        """Bytes of staging held by READs now (their size classes)."""
        self.in_use_max = 0
        self.reads = 0
        """READs holding room now."""
        self.reads_max = 0
        self.waits = 0
        """READs that waited for room."""
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._free: list[tuple[int, int, torch.Tensor, str]] = []   # (nbytes, seq, tensor, name)
        self._cached = 0
        self._seq = 0

    def _fits(self, size: int) -> bool:
        return self.in_use == 0 or self.in_use + size <= self.inflight_bytes

    def _hold(self, size: int) -> None:
        self.in_use += size
        self.in_use_max = max(self.in_use_max, self.in_use)
        self.reads += 1
        self.reads_max = max(self.reads_max, self.reads)

    async def room(self, nbytes: int, timeout: float | None) -> int:
        """Wait (up to ``timeout`` s) until a READ of ``nbytes`` may stage; returns what to
        ``release`` after it. Raises transport TransferTimeout."""
        size = _size_class(nbytes)
        if not self._waiters and self._fits(size):
            self._hold(size)
            return size
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((size, fut))
        self.waits += 1
        try:
            async with asyncio.timeout(timeout):
                await fut
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self.release(size)          # granted as it gave up: hand it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove((size, fut))
                self._grant()               # a smaller one behind it may fit now
            if isinstance(e, TimeoutError):
                raise TE.TransferTimeout(f"no room to stage {nbytes} bytes within {timeout} s "
                                         f"({self.in_use} of {self.inflight_bytes} in use)"
                                         ) from None
            raise
        return size

    def release(self, size: int) -> None:
        """A READ's room back (``room``'s result); wakes the waiters it lets in."""
        self.in_use -= size
        self.reads -= 1
        self._grant()

    def _grant(self) -> None:
        w = self._waiters
        while w:
            size, fut = w[0]
            if fut.done():
                w.popleft()
                continue
            if not self._fits(size):
                return
            w.popleft()
            self._hold(size)
            fut.set_result(None)

    def take(self, nbytes: int) -> tuple[torch.Tensor, str]:
        size = _size_class(nbytes)
        i = bisect.bisect_left(self._free, (size, -1))
        if i < len(self._free) and self._free[i][0] == size:
            _, _, buf, name = self._free.pop(i)
            self._cached -= size
            return buf, name
        self._seq += 1
        name = f"tract-nixl-rx-{self._seq}"
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.agent.register_memory(buf, name=name)
        return buf, name

    def give(self, buf: torch.Tensor, name: str) -> None:
        if self.agent.closing or self.agent.registry.in_use(name):
            return                                     # quarantined (or closing): never again
        if self._cached + buf.numel() > self.limit_bytes:
            self.agent.deregister_memory(name)
            return
        self._seq += 1
        bisect.insort(self._free, (buf.numel(), self._seq, buf, name))
        self._cached += buf.numel()


class NixlStore(HttpStore):
    """put / get / lookup with NIXL as the data path (module docstring). Owned by the Engine."""

    transport_name = "nixl"
    stats_type = NixlStats

    def __init__(self, cfg: EngineConfig, *, region_uuid: str | None = None) -> None:
        super().__init__(cfg, region_uuid=region_uuid)
        self.nixl = NixlAgent(self.agent.name, progress_thread=cfg.nixl_progress_thread)
        self.nixl_pool = self.nixl.register_memory(self.pool.bytes, name=POOL_NAME, writable=False)
        self.nixl.set_notif_handler(self._on_nixl_notif)
        self._staging = _Staging(self.nixl, self.pool.bytes.device, STAGING_CACHE_BYTES,
                                 cfg.nixl_staging_bytes)
        self._nixl_peers: set[str] = set()

    def _pool_device(self) -> str:
        return self.cfg.nixl_pool_device

    @property
    def takes_cuda(self) -> bool:
        """CUDA tensors are put and got directly (the pool is in GPU memory)."""
        return self.pool.bytes.is_cuda

    # -- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Start the NIXL agent, then the HTTP side (which joins the configured peers)."""
        await self.nixl.start()
        try:
            await super().open()
        except BaseException:
            await self.nixl.close()
            raise

    async def close(self, timeout: float) -> None:
        """Say bye and close the HTTP side first (peers stop reading), then the NIXL agent."""
        errors: list[BaseException] = []
        try:
            await super().close(timeout)
        except Exception as e:  # noqa: BLE001 - keep going: NIXL must still be released
            errors.append(e)
        try:
            await self.nixl.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        if errors:
            raise errors[0]

    # -- peering ------------------------------------------------------------------------------
    def _hello_extra(self) -> dict[str, Any]:
        return {"nixl": base64.b64encode(self.nixl.get_agent_metadata()).decode()}

    def _peer_joined(self, name: str, hello: dict[str, Any]) -> None:
        md = hello.get("nixl")
        if md is None:
            return                        # an HTTP-transport peer: read over HTTP
        if not isinstance(md, str):
            raise TE.MalformedRequest("hello: nixl must be base64 NIXL metadata")
        try:
            raw = base64.b64decode(md, validate=True)
        except ValueError:
            raise TE.MalformedRequest("hello: nixl is not base64") from None
        pool = self.agent.remote_region(name, POOL_NAME)   # the same pool, published over HTTP
        got = self.nixl.add_remote_agent(raw, regions=[dataclasses.replace(pool, writable=False)])
        if got != name:
            self.nixl.remove_remote_agent(got)
            raise TE.MalformedRequest(f"hello: the NIXL metadata names agent {got!r}, "
                                      f"not the sender {name!r}")
        self._nixl_peers.add(name)

    def _peer_left(self, name: str) -> None:
        if name in self._nixl_peers:
            self._nixl_peers.discard(name)
            self.nixl.remove_remote_agent(name)

    # -- put side -----------------------------------------------------------------------------
    def _publishing(self, ops: list[list[Any]], layer: int | None) -> None:
        """Readers follow a put: progress hot. A layer put: notify NIXL peers first."""
        self.nixl.keep_hot()
        if layer is None or not ops or len(ops) > MAX_NOTIF_OPS:
            return
        msg = NOTIF_LAYERS + orjson.dumps([op for op in ops if op[0] == "p"])
        for name in list(self._nixl_peers):
            try:
                self.nixl.send_notif(name, msg)
                self.stats.layer_notifs_sent += 1
            except TE.TransportError:
                pass    # a fast path only: the HTTP announcement follows (and notices failures)

    def _served_check(self, sender: str) -> None:
        self.nixl.keep_hot()

    def _on_nixl_notif(self, sender: str, msg: bytes) -> None:
        """Layer readiness from a peer (a hint: ``Directory.add_layers``). Never raises."""
        if not msg.startswith(NOTIF_LAYERS) or sender not in self._nixl_peers:
            self.stats.notifs_refused += 1
            return
        try:
            ops = ops_list(orjson.loads(msg[len(NOTIF_LAYERS):]), "layer notification")
            parsed = parse_ops(ops, self.pool.full_mask)
        except (orjson.JSONDecodeError, TE.MalformedRequest):
            self.stats.notifs_refused += 1
            return
        self.stats.layer_notifs_applied += self.dir.add_layers(sender, parsed)

    # -- get side -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _fetch(self, peer_name: str, remote_addrs: list[int], span: int,
                     deadline: float | None) -> AsyncIterator[torch.Tensor]:
        """One NIXL READ of the spans into reused staging (HTTP for peers without NIXL)."""
        if peer_name not in self._nixl_peers:
            self.stats.reads_http += 1
            async with super()._fetch(peer_name, remote_addrs, span, deadline) as staging:
                yield staging
            return
        m = len(remote_addrs)
        t0 = time.monotonic()
        held = await self._staging.room(m * span, deadline)
        try:
            if deadline is not None:        # (a timeout in seconds: what waiting left of it)
                deadline = max(0.0, deadline - (time.monotonic() - t0))
            buf, name = self._staging.take(m * span)
            try:
                info: RegionInfo = self.nixl.registry.get(name)
                await self._read_into(self.nixl, peer_name, info.addr, info.mem_type,
                                      info.dev_id, remote_addrs, span, deadline)
                self.stats.reads_nixl += 1
                yield buf[:m * span]
            finally:
                self._staging.give(buf, name)
        finally:
            self._staging.release(held)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        st = self._staging
        out["nixl"] = {**self.nixl.describe(), "nixl_peers": sorted(self._nixl_peers),
                       "staging": {"in_use": st.in_use, "in_use_max": st.in_use_max,
                                   "limit": st.inflight_bytes, "waits": st.waits,
                                   "reads_max": st.reads_max}}
        return out
