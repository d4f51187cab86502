"""The HTTP path of the Engine: put, get and lookup of KV blocks over NIXL-style agents.

Where no shared region reaches, each engine runs an ``Agent`` (``transport.http``) and keeps
the blocks it produces in a local pool (``stores/pool.BlockPool``: one CPU tensor registered with
the agent, carved into block slots). Peers read them by descriptor. Same interface as
``RegionStore``: ``put``, ``get``, ``lookup``, ``maintain``, ``close``, ``stats``.

Directory. ``lookup`` must never block, so every engine keeps a local directory of which peer
holds which key, at which pool slot and version, with which layers landed. It is fed by pushes:

* joining: an engine fetches each configured peer's metadata and says *hello* (its own metadata,
  its region uuid, its node id); the answer carries the peer's region uuid and its whole list of
  blocks. The peer adds the newcomer, so peering is symmetric whichever side was configured;
* announcements: every put announces ``(key, slot, version, layers)`` to every peer, every
  eviction (LRU, consumed, expired, close) announces ``(key, slot, version)``. One sender task per
  peer sends them in order, batching whatever queued up while the last batch was in flight; a
  put returns once its announcement was delivered (or failed: the peer is then dropped, its
  entries forgotten, and it must say hello again), so a peer's ``lookup`` right after
  ``await put_kv`` already counts the blocks;
* waiters: ``get_kv(timeout=)`` waits on an ``asyncio.Event`` that each directory change sets
  (one event per generation, as the Agent's notifications): no polling.

Validation (docs/design.md invariant 6 over HTTP). A directory entry may be stale (an announcement
still in flight, a lost one, a reordered one), so it is only a hint. A remote get READs the slots
it names, then asks the holder to *check* each ``(key, slot, version, layer)`` against its pool.
Versions are never reused and a slot is rewritten only after its block was evicted (which forgets
the version), so "still the same version after the bytes arrived" proves the bytes are the
block's. Any mismatch raises ``BlockEvicted`` (a miss, never wrong bytes) and drops the stale
entries. The check also carries LRU touches and, in transfer mode, the consume of blocks whose
last layer was read.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from ..arrays import require_torch
from ..config import EngineConfig
from ..errors import BlockEvicted, TractError, TransferTimeout
from .directory import (Directory, Held, evict_op, ops_list, parse_key, parse_ops,
                             parse_uint, put_op)
from .pool import BlockPool
from .poolsteps import PoolLifecycle
from .stats import TransferStats
from .txn import PutTxn, ReadTxn
from ..transport import errors as TE
from ..transport.descs import XferDescList
from ..transport.http import Agent

torch = require_torch("the network store (peers=..., the HTTP fallback)")

POOL_NAME = "tract-kv-pool"
ROUTE_HELLO = "/tract-kv/v1/hello"
ROUTE_ANNOUNCE = "/tract-kv/v1/announce"
ROUTE_CHECK = "/tract-kv/v1/check"


@dataclasses.dataclass
class HttpStats(TransferStats):
    """The HTTP store's counters: the shared ones plus peer traffic."""
    remote_reads: int = 0            # READ transfers from peers
    blocks_read_remote: int = 0
    blocks_read_foreign: int = 0     # ... from peers of another region (rack)
    announcements_sent: int = 0
    announce_failures: int = 0
    peers_dropped: int = 0


@dataclasses.dataclass(eq=False)
class _Peer:
    name: str
    uuid: str | None
    node_id: int
    pool_addr: int
    pool_mem_type: str = "DRAM"      # where the peer's pool lives: DRAM, or VRAM of ``pool_dev``
    pool_dev: int = 0
    outbox: list[list[Any]] = dataclasses.field(default_factory=list)
    waiters: list[asyncio.Future[None]] = dataclasses.field(default_factory=list)
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    alive: bool = True


async def copies_landed(device: torch.device) -> None:
    """Wait, off the loop, for the copies queued so far on ``device``'s current stream.

    A pool in GPU memory is written on the stream; peers READ it through NIXL/UCX on streams
    of their own once the put is announced, so the announcement must follow the bytes."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    if not done.query():
        await asyncio.to_thread(done.synchronize)


class HttpStore:
    """put / get / lookup over agents for one engine. Created and owned by the Engine.

    Subclasses change the data path and keep the rest (``stores/nixl.py``): the hooks are
    ``_hello_extra`` / ``_peer_joined`` / ``_peer_left`` (what peering exchanges beyond the
    directory), ``_fetch`` (how the bytes of a remote get arrive), ``_publishing`` (a put is about
    to announce) and ``_served_check`` (a peer has just read from this pool).
    """

    transport_name = "http"
    stats_type: type[HttpStats] = HttpStats
    """The counters' class (a subclass counts more: ``NixlStats``)."""

    def __init__(self, cfg: EngineConfig, *, region_uuid: str | None = None) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.region_uuid = region_uuid
        self.stats = self.stats_type()
        self.pool = BlockPool(cfg.layout, cfg.http_pool_bytes or cfg.region_bytes, mode=cfg.mode,
                              deadline_s=cfg.transfer_deadline_s, device=self._pool_device())
        self.agent = Agent(f"tract-n{cfg.node_id}-{secrets.token_hex(4)}", host=cfg.listen_host,
                           port=cfg.listen_port, secret=cfg.secret,
                           allow_unauthenticated=cfg.allow_unauthenticated)
        self.agent.register_memory(self.pool.bytes, name=POOL_NAME, writable=False)
        self.agent.add_json_route(ROUTE_HELLO, self._on_hello)
        self.agent.add_json_route(ROUTE_ANNOUNCE, self._on_announce)
        self.agent.add_json_route(ROUTE_CHECK, self._on_check)
        self.peers: dict[str, _Peer] = {}
        self.dir = Directory()
        self.directory = self.dir.entries      # key -> {peer: Held}; never rebound
        self.steps = PoolLifecycle(cfg, self.pool, self.dir, self.stats, self._announce)
        """The put and read steps on the pool (``stores/poolsteps.py``)."""
        self._tg: asyncio.TaskGroup | None = None
        self._rx = 0
        self.validate_reads = True
        """Check versions after each remote READ. Only the stale-entry test's negative control
        turns this off, to show that without it wrong bytes get through."""
        self.announce_timeout_s = max(2.0, 4 * cfg.liveness_timeout_s)

    def _pool_device(self) -> str:
        """Where the block pool lives (a subclass may keep it in GPU memory)."""
        return "cpu"

    # -- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Start the agent and join every configured peer. Raises TransportConfigError, OSError
        (port taken), PeerUnreachable / AuthenticationFailed / ... (a peer cannot be joined)."""
        await self.agent.start()
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        for url in self.cfg.peers:
            await self.join(url, timeout=self.announce_timeout_s)

    @property
    def url(self) -> str:
        host = self.agent.config.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.agent.port}"

    async def join(self, url: str, *, timeout: float) -> str:
        """Peer with the engine serving at ``url`` (both sides learn each other); its name."""
        name = await self.agent.fetch_remote_metadata(url, timeout=timeout)
        reply = await self.agent.call(name, ROUTE_HELLO, self._hello_payload(), timeout=timeout)
        if not isinstance(reply, dict):
            raise TE.RemoteError(f"{name}: hello reply is not an object")
        self._add_peer(name, reply.get("uuid"), reply.get("node"))
        self._peer_joined(name, reply)
        self._apply(name, ops_list(reply.get("blocks"), "hello blocks"))
        return name

    def _hello_payload(self) -> dict[str, Any]:
        md = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"md": md, "uuid": self.region_uuid, "node": self.cfg.node_id,
                "blocks": [put_op(k, b) for k, b in self.pool.items()], **self._hello_extra()}

    def _hello_extra(self) -> dict[str, Any]:
        """Fields a subclass adds to the hello and to its reply (e.g. its NIXL metadata)."""
        return {}

    def _peer_joined(self, name: str, hello: dict[str, Any]) -> None:
        """A peer was added from its hello (or hello reply); raise MalformedRequest to refuse it."""

    def _peer_left(self, name: str) -> None:
        """A peer was dropped (bye, failure, close)."""

    def _add_peer(self, name: str, uuid: Any, node: Any) -> None:
        if uuid is not None and not isinstance(uuid, str):
            raise TE.MalformedRequest("hello: uuid must be a string or null")
        node_id = parse_uint(node, "hello: node", 1 << 16)
        pool = self.agent.remote_region(name, POOL_NAME)
        old = self.peers.get(name)
        if old is not None:
            self._drop_peer(old, count=False)
        peer = _Peer(name=name, uuid=uuid, node_id=node_id, pool_addr=pool.addr,
                     pool_mem_type=pool.mem_type, pool_dev=pool.dev_id)
        self.peers[name] = peer
        assert self._tg is not None, "HttpStore: peer added before open()"
        self._tg.create_task(self._sender(peer), name=f"tract-announce-{name}")

    def _drop_peer(self, peer: _Peer, *, count: bool = True) -> None:
        """Forget a peer: its directory entries, its outbox; its sender task ends."""
        peer.alive = False
        peer.wake.set()
        if self.peers.get(peer.name) is peer:
            del self.peers[peer.name]
            self.stats.peers_dropped += count
        for f in peer.waiters:
            if not f.done():
                f.set_result(None)
        peer.waiters.clear()
        self.dir.forget_peer(peer.name)
        self._peer_left(peer.name)

    async def close(self, timeout: float) -> None:
        """Tell peers this node's blocks are gone, stop the senders, close the agent."""
        errors: list[BaseException] = []
        if self._tg is not None:
            bye = [["bye"]]
            for k, _ in self.pool.items():     # unfinished ones too
                self.pool.evict(k)
            try:
                await self._announce(bye, timeout=min(timeout, self.announce_timeout_s))
            except Exception as e:  # noqa: BLE001 - keep going, report after cleanup
                errors.append(e)
            for p in list(self.peers.values()):
                self._drop_peer(p, count=False)
            tg, self._tg = self._tg, None
            try:
                await tg.__aexit__(None, None, None)
            except BaseExceptionGroup as eg:  # noqa: F821
                errors.extend(eg.exceptions)
        try:
            await self.agent.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        if errors:
            raise errors[0]

    # -- announcements ------------------------------------------------------------------------
    def _announce_nowait(self, ops: list[list[Any]]) -> list[asyncio.Future[None]]:
        futs = []
        if not ops:
            return futs
        loop = asyncio.get_running_loop()
        for p in self.peers.values():
            if p.alive:
                p.outbox.extend(ops)
                f = loop.create_future()
                p.waiters.append(f)
                futs.append(f)
                p.wake.set()
        return futs

    async def _announce(self, ops: list[list[Any]], *, timeout: float | None = None) -> None:
        """Queue ``ops`` for every peer and wait until delivered (or the peer was dropped)."""
        futs = self._announce_nowait(ops)
        if futs:
            await asyncio.wait(futs, timeout=timeout or self.announce_timeout_s)

    async def _sender(self, peer: _Peer) -> None:
        """One per peer: sends queued ops in order, one batch in flight. Never raises."""
        while peer.alive:
            await peer.wake.wait()
            peer.wake.clear()
            if not peer.outbox or not peer.alive:
                continue
            ops, peer.outbox = peer.outbox, []
            waiters, peer.waiters = peer.waiters, []
            try:
                await self.agent.call(peer.name, ROUTE_ANNOUNCE, {"ops": ops},
                                      timeout=self.announce_timeout_s)
                self.stats.announcements_sent += 1
            except (TractError, OSError):
                # unreachable or refusing: forget it; it says hello again when it comes back
                self.stats.announce_failures += 1
                self._drop_peer(peer)
            finally:
                for f in waiters:
                    if not f.done():
                        f.set_result(None)

    async def _on_hello(self, sender: str, payload: Any) -> Any:
        if not isinstance(payload, dict) or not isinstance(payload.get("md"), str):
            raise TE.MalformedRequest("hello needs an object with md (base64 agent metadata)")
        ops = ops_list(payload.get("blocks", []), "hello blocks")
        parsed = parse_ops(ops, self.pool.full_mask)
        try:
            md = base64.b64decode(payload["md"], validate=True)
        except ValueError:
            raise TE.MalformedRequest("hello: md is not base64") from None
        from ..transport import wire
        if wire.decode_metadata(md).name != sender:
            raise TE.MalformedRequest(f"hello: metadata names another agent than the sender {sender!r}")
        self.agent.add_remote_agent(md)
        try:
            self._add_peer(sender, payload.get("uuid"), payload.get("node"))
            self._peer_joined(sender, payload)
        except BaseException:
            if sender in self.peers:
                self._drop_peer(self.peers[sender], count=False)
            self.agent.remove_remote_agent(sender)
            raise
        self._apply_parsed(sender, parsed)
        return {"uuid": self.region_uuid, "node": self.cfg.node_id,
                "blocks": [put_op(k, b) for k, b in self.pool.items()], **self._hello_extra()}

    async def _on_announce(self, sender: str, payload: Any) -> Any:
        if sender not in self.peers:
            raise TE.MalformedRequest(f"announce from {sender!r}, which has not said hello")
        if not isinstance(payload, dict):
            raise TE.MalformedRequest("announce needs an object with ops")
        self._apply(sender, ops_list(payload.get("ops"), "announce ops"))
        return {"ok": True}

    def _apply(self, peer: str, ops: list[Any]) -> None:
        self._apply_parsed(peer, parse_ops(ops, self.pool.full_mask))

    def _apply_parsed(self, peer: str, parsed: list[tuple]) -> None:
        if self.dir.apply(peer, parsed):   # bye: the peer closed
            p = self.peers.get(peer)
            if p is not None:
                self._drop_peer(p, count=False)
                self.agent.remove_remote_agent(peer)

    def _wake(self) -> None:
        self.dir.wake()

    async def wait_changed(self) -> None:
        """Until the next change of the directory or the pool (check your condition first)."""
        await self.dir.wait_changed()

    # -- the check route (producer side of validation) ----------------------------------------
    async def _on_check(self, sender: str, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise TE.MalformedRequest("check needs an object with e")
        rows = ops_list(payload.get("e"), "check entries")
        parsed = []
        for r in rows:
            if not isinstance(r, list) or len(r) != 5 or not isinstance(r[4], bool):
                raise TE.MalformedRequest(f"check entry must be [key, slot, version, layer, consume], "
                                          f"got {r!r:.80}")
            layer = r[3]
            if not isinstance(layer, int) or isinstance(layer, bool) or \
                    not -1 <= layer < self.layout.num_layers:
                raise TE.MalformedRequest(f"check entry has a bad layer {layer!r:.20}")
            parsed.append((parse_key(r[0]), parse_uint(r[1], "slot"), parse_uint(r[2], "version"),
                           None if layer < 0 else layer, r[4]))
        ok, gone = [], []
        for key, slot, version, layer, consume in parsed:
            good = self.pool.holds(key, slot, version, layer)
            ok.append(good)
            if good and consume:
                gone.append((key, self.pool.evict(key)))
            elif good:
                self.pool.touch(key)
        self._announce_nowait([evict_op(k, b) for k, b in gone if b is not None])
        self._served_check(sender)
        return {"ok": ok}

    def _served_check(self, sender: str) -> None:
        """A peer has just read from this pool (it checks after each READ)."""

    # -- lookup -------------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        """Is ``key`` held here or announced by a peer (complete or not)?"""
        return self.steps.has(key)

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are complete here or at some peer."""
        return self.steps.lookup(keys)

    def foreign_peers(self) -> list[str]:
        """Peers outside this engine's region (another rack, or no region at all)."""
        return [p.name for p in self.peers.values() if p.uuid != self.region_uuid]

    # -- put ----------------------------------------------------------------------------------
    async def put(self, keys: list[bytes], kv: torch.Tensor, layer: int | None,
                  timeout: float | None) -> int:
        """Store blocks not yet held by this node or announced by a peer; returns how many this
        call stored (or filled). One ``PutTxn`` on the pool's lifecycle (``stores/poolsteps.py``)
        whose copy back-end is a torch copy into the pool's slots; then every peer hears of the
        put (and of what its reservation evicted). A ``kv`` on another device than the pool is
        copied there first (this is the network path, where that copy is not what costs).
        Raises RegionFull (the pool is full)."""
        kv = kv.contiguous()
        if kv.device != self.pool.blocks.device:
            kv = kv.to(self.pool.blocks.device)
        txn = PutTxn(self.steps, keys, layer, timeout, "http")
        n = 0
        landed: list[list[Any]] = []
        if await txn.begin():
            try:
                self._copy_in(txn, kv)
                if self.pool.blocks.is_cuda:
                    await copies_landed(self.pool.blocks.device)
            except BaseException:
                if self.pool.blocks.is_cuda:   # abandon only once no byte can land any more
                    torch.cuda.current_stream(self.pool.blocks.device).synchronize()
                await txn.abandon()
                raise
            lay = self.layout
            n = txn.publish(len(txn.todo) * (lay.block_bytes if layer is None else lay.layer_bytes))
            landed = [put_op(keys[i], b) for i, b in zip(txn.todo, txn.res)]
        ops = [*txn.notices, *landed]
        self._publishing(ops, layer)
        await self._announce(ops, timeout=txn.left())
        return n

    def _copy_in(self, txn: PutTxn, kv: torch.Tensor) -> None:
        """The put's copy: ``kv``'s blocks at ``txn.todo`` into their reserved pool slots. No
        ``await`` since the reservation: nothing else sees the slots half written."""
        L, T, H, D = (self.layout.num_layers, self.layout.block_tokens, self.layout.kv_heads,
                      self.layout.head_dim)
        n = len(txn.keys)
        slots = torch.tensor([b.slot for b in txn.res], dtype=torch.long)
        pos = torch.tensor(list(txn.todo), dtype=torch.long)
        if txn.layer is None:
            self.pool.blocks[slots] = kv.view(L, 2, n, T, H, D)[:, :, pos].permute(2, 0, 1, 3, 4, 5)
        else:
            self.pool.blocks[slots, txn.layer] = kv.view(2, n, T, H, D)[:, pos].permute(1, 0, 2, 3, 4)

    def _publishing(self, ops: list[list[Any]], layer: int | None) -> None:
        """A put (of ``layer``, or all layers) is about to announce ``ops`` to every peer and
        wait for their answers."""

    # -- get ----------------------------------------------------------------------------------
    async def get(self, keys: list[bytes], out: torch.Tensor, layer: int | None,
                  timeout: float | None) -> torch.Tensor:
        """Read ``keys`` into ``out``: one ``ReadTxn`` on the pool's lifecycle. Local blocks are
        copied right after ``prepare`` (no ``await`` in between), a peer's blocks are READ from
        its pool, checked by the holder and copied out (``_read_remote``). An ``out`` on another
        device than the pool is filled through a staging tensor on the pool's device."""
        if out.device != self.pool.blocks.device:
            stage = torch.empty(out.shape, dtype=out.dtype, device=self.pool.blocks.device)
            await self.get(keys, stage, layer, timeout)
            out.copy_(stage)
            return out
        n = len(keys)
        txn = ReadTxn(self.steps, keys, layer, timeout, "http")
        srcs = await txn.prepare()
        L, T, H, D = (self.layout.num_layers, self.layout.block_tokens, self.layout.kv_heads,
                      self.layout.head_dim)
        outv = out.view(L, 2, n, T, H, D) if layer is None else out.view(2, n, T, H, D)
        by_peer: dict[str, list[int]] = {}
        local = []
        for i, (peer, _) in enumerate(srcs):
            (local.append(i) if peer is None else by_peer.setdefault(peer, []).append(i))
        if local:   # synchronous after prepare: no eviction can interleave, no check needed
            self._copy_out(outv, local, layer,
                           self._local_view([srcs[i][1].slot for i in local], layer))
        for peer, pos in by_peer.items():
            await self._read_remote(peer, [keys[i] for i in pos], [srcs[i][1] for i in pos], pos,
                                    outv, layer, txn)
        span = self.layout.block_bytes if layer is None else self.layout.layer_bytes
        txn.validate(n * span)
        await txn.consume()
        return out

    def _local_view(self, slots: list[int], layer: int | None) -> torch.Tensor:
        idx = torch.tensor(slots, dtype=torch.long)
        return self.pool.blocks[idx] if layer is None else self.pool.blocks[idx, layer]

    @staticmethod
    def _copy_out(outv: torch.Tensor, pos: list[int], layer: int | None,
                  src: torch.Tensor) -> None:
        """``src``: (m, L, 2, T, H, D) or (m, 2, T, H, D) blocks for positions ``pos``."""
        if src.device != outv.device:          # a pool in GPU memory, a CPU tensor (or back)
            src = src.to(outv.device)
        p = torch.tensor(pos, dtype=torch.long)
        if layer is None:
            outv[:, :, p] = src.permute(1, 2, 0, 3, 4, 5)
        else:
            outv[:, p] = src.permute(1, 0, 2, 3, 4)

    async def _read_remote(self, peer_name: str, keys: list[bytes], helds: list[Held],
                           pos: list[int], outv: torch.Tensor, layer: int | None,
                           txn: ReadTxn) -> None:
        """READ the blocks from the peer's pool, check their versions there, copy them out,
        each step within what is left of the read's deadline (``txn``). Raises BlockEvicted,
        TransferTimeout."""
        peer = self.peers.get(peer_name)
        if peer is None:
            raise BlockEvicted(f"peer {peer_name!r} left while the read was planned; treat as a miss")
        lay = self.layout
        span = lay.block_bytes if layer is None else lay.layer_bytes
        skip = 0 if layer is None else layer * lay.layer_bytes
        consume = [self.cfg.mode == "transfer" and self.steps.would_consume(k, layer) for k in keys]
        remote_addrs = [peer.pool_addr + h.slot * lay.block_bytes + skip for h in helds]
        async with self._fetch_guarded(peer_name, remote_addrs, span, txn.limit()) as staging:
            await self._check_and_copy(peer_name, peer, keys, helds, pos, outv, layer, consume,
                                       staging, txn.limit())

    @contextlib.asynccontextmanager
    async def _fetch_guarded(self, peer_name: str, remote_addrs: list[int], span: int,
                             deadline: float | None) -> AsyncIterator[torch.Tensor]:
        """``_fetch`` with the transport's failures turned into the store's: TransferTimeout,
        or (the peer went away) BlockEvicted after dropping the peer."""
        try:
            async with self._fetch(peer_name, remote_addrs, span, deadline) as staging:
                yield staging
        except TE.TransferTimeout as e:
            raise TransferTimeout(f"READ of {len(remote_addrs)} blocks from {peer_name!r} timed "
                                  f"out: {e}") from e
        except (TE.PeerUnreachable, TE.PeerDisconnected, TE.AgentClosed) as e:
            raise self._went_away(peer_name, e) from e

    def _went_away(self, peer_name: str, e: BaseException) -> BlockEvicted:
        """Drop a peer that failed mid-read; the error the get raises (a miss)."""
        if peer_name in self.peers and not self.agent.closing:
            self._drop_peer(self.peers[peer_name])
        return BlockEvicted(f"peer {peer_name!r} went away during the read ({e}); treat as a miss")

    @contextlib.asynccontextmanager
    async def _fetch(self, peer_name: str, remote_addrs: list[int], span: int,
                     deadline: float | None) -> AsyncIterator[torch.Tensor]:
        """READ ``span`` bytes at each of ``remote_addrs`` in the peer's pool into a fresh staging
        tensor (``len * span`` bytes, in order), valid inside the context. Raises the transport's
        errors (``transport.errors``)."""
        m = len(remote_addrs)
        staging = torch.empty(m * span, dtype=torch.uint8)
        self._rx += 1
        name = f"tract-rx-{self._rx}"
        self.agent.register_memory(staging, name=name)
        try:
            await self._read_into(self.agent, peer_name, staging.data_ptr(), "DRAM", 0,
                                  remote_addrs, span, deadline)
        finally:
            self.agent.deregister_memory(name)
        yield staging

    async def _read_into(self, agent: Any, peer_name: str, base: int, mem_type: str, dev: int,
                         remote_addrs: list[int], span: int, deadline: float | None) -> None:
        """One READ of ``span`` bytes at each remote address into consecutive spans from
        ``base``, through ``agent`` (the HTTP Agent, or a NixlAgent: the same calls)."""
        peer = self.peers[peer_name]
        local = XferDescList([(base + j * span, span, dev) for j in range(len(remote_addrs))],
                             mem_type)
        remote = XferDescList([(a, span, peer.pool_dev) for a in remote_addrs], peer.pool_mem_type)
        x = agent.initialize_xfer("READ", local, remote, peer_name)
        try:
            await agent.transfer(x, timeout=deadline)
        finally:
            x.release()

    async def _check_and_copy(self, peer_name: str, peer: _Peer, keys: list[bytes],
                              helds: list[Held], pos: list[int], outv: torch.Tensor,
                              layer: int | None, consume: list[bool], staging: torch.Tensor,
                              deadline: float | None) -> None:
        """After the bytes arrived: ask the holder whether they are still the blocks' (and
        consume them in transfer mode), then copy them out. Raises BlockEvicted, TransferTimeout."""
        lay = self.layout
        m = len(keys)
        try:
            self.stats.remote_reads += 1
            ok = [True] * m
            if self.validate_reads or any(consume):
                reply = await self.agent.call(peer_name, ROUTE_CHECK, {"e": [
                    [k.hex(), h.slot, h.version, -1 if layer is None else layer, c]
                    for k, h, c in zip(keys, helds, consume)]}, timeout=deadline)
                ok = reply.get("ok") if isinstance(reply, dict) else None
                if not isinstance(ok, list) or len(ok) != m or not all(isinstance(x, bool) for x in ok):
                    raise TE.RemoteError(f"{peer_name}: malformed check reply")
                if not self.validate_reads:
                    ok = [True] * m
        except TE.TransferTimeout as e:
            raise TransferTimeout(f"check of {m} blocks with {peer_name!r} timed out: {e}") from e
        except (TE.PeerUnreachable, TE.PeerDisconnected, TE.AgentClosed) as e:
            raise self._went_away(peer_name, e) from e
        bad = [j for j in range(m) if not ok[j]]
        if bad:
            for j in bad:
                self.dir.forget(keys[j], peer_name, helds[j].version)
            self.stats.validation_failures += 1
            self.stats.misses += len(bad)
            raise BlockEvicted(f"{len(bad)} of {m} blocks read from {peer_name!r} were evicted "
                               f"there (first: {keys[bad[0]][:8].hex()}…); the output is not "
                               f"trusted: treat as a miss")
        shape = (m, lay.num_layers, 2, lay.block_tokens, lay.kv_heads, lay.head_dim)
        src = staging.view(lay.dtype).view(shape if layer is None else (m,) + shape[2:])
        self._copy_out(outv, pos, layer, src)
        self.stats.blocks_read_remote += m
        if peer.uuid != self.region_uuid:
            self.stats.blocks_read_foreign += m
        if self.cfg.mode == "transfer":        # the holder consumed what ``consume`` named
            self.steps.consumed_remote(keys, peer_name, layer)

    # -- maintenance --------------------------------------------------------------------------
    async def maintain(self, timeout: float) -> None:
        """Free transfer-only blocks whose deadline passed, and announce it."""
        keys = self.pool.expired(time.monotonic_ns())
        if not keys:
            return
        gone = [(k, self.pool.evict(k)) for k in keys]
        self.stats.expired += len(gone)
        self.stats.evictions += len(gone)
        self._wake()
        await self._announce([evict_op(k, b) for k, b in gone if b is not None],
                             timeout=timeout)

    def describe(self) -> dict[str, Any]:
        """What Engine.stats() shows about the HTTP side beyond the counters."""
        return {"url": self.url if self.agent.started else None, "agent": self.agent.name,
                "region_uuid": self.region_uuid,
                "peers": {p.name: {"node_id": p.node_id, "region_uuid": p.uuid}
                          for p in self.peers.values()},
                "directory_keys": len(self.directory),
                "pool": {"slots": self.pool.nslots, "free": self.pool.free_slots},
                "reserved_in_flight": len(self.pool.reserved())}
