"""The network store's block lifecycle: the steps ``PutTxn`` and ``ReadTxn`` run on the HTTP pool.

A put or a read over HTTP or NIXL is the same transaction (``stores/txn.py``) as one into the
shared region: reserve -> copy -> publish (or abandon), prepare -> copy -> validate -> consume.
The region's lifecycle (``stores/blocks.py``) keeps those steps against the shared index; this
one keeps them against the engine's local block pool (``stores/pool.py``) and its directory of
what peers announced (``stores/directory.py``). The store (``stores/http.py``) is the copy
back-end: it moves the bytes (a torch copy into or out of pool slots, a READ from a peer's pool)
and tells peers what changed.

| step | the region (``BlockLifecycle``) | the HTTP pool (``PoolLifecycle``) |
|---|---|---|
| reserve | index entries under the lock | pool slots (cache mode: LRU complete blocks evicted for room; their evictions go out with the put's announcement, ``PutTxn.notices``) |
| publish | layer bits, READY after the last layer | the pool's landed mask; the store announces the put |
| abandon | evict this node's reservations | evict the unfinished blocks from the pool and announce it |
| prepare | the index snapshot (waits up to the deadline) | each key's source: this pool's block, or a peer's announced ``Held`` (a hint); waits on directory changes up to the deadline |
| validate | entry versions re-read after the copy | a local copy ran without an ``await`` after ``prepare`` (nothing can interleave: nothing to check); a remote block was checked by its holder before the store copied it out of staging (``HttpStore._check_and_copy``, docs/design.md invariant 6 over HTTP). Counts the read and touches the local blocks |
| consume | free blocks read whole (transfer mode) | evict local blocks this node has read whole and announce it; a peer's block was consumed by its holder during the check, and ``consumed_remote`` forgets it here |

Only the event loop's thread calls these steps (the pool and the directory are plain dicts).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import EngineConfig
from ..errors import BlockNotFound, LayerNotReady, TransferTimeout
from .directory import Directory, Held, evict_op
from .pool import BlockPool, LocalBlock
from .stats import TransferStats

if TYPE_CHECKING:
    from .txn import PutTxn

Source = tuple[str | None, LocalBlock | Held]
"""Where one key of a read comes from: (None, this pool's block) or (peer name, its ``Held``)."""

Announce = Callable[[list[list[Any]]], Awaitable[None]]
"""The store's announcement of ops to every peer (``HttpStore._announce``)."""


class PoolLifecycle:
    """The put and read steps of the HTTP store's pool (module docstring). Owned by the store,
    which passes it to every ``PutTxn`` and ``ReadTxn`` it opens."""

    def __init__(self, cfg: EngineConfig, pool: BlockPool, directory: Directory,
                 stats: TransferStats, announce: Announce) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.pool = pool
        self.dir = directory
        self.stats = stats
        self._announce = announce
        self._consumed_layers: dict[bytes, int] = {}
        """Transfer mode: the layers of each key this node has read so far (bit l = layer l)."""

    # -- what is where ------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        """Is ``key`` held here or announced by a peer (complete or not)?"""
        return self.pool.get(key) is not None or key in self.dir.entries

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are complete here or at some peer."""
        n = 0
        for k in keys:
            b = self.pool.get(k)
            if not ((b is not None and b.complete)
                    or any(h.complete for h in self.dir.entries.get(k, {}).values())):
                break
            n += 1
        return n

    def source(self, key: bytes, layer: int | None) -> Source | None:
        """Where ``key`` (with ``layer``; None: every layer) can be read now, or None."""
        b = self.pool.get(key)
        if b is not None and (b.complete if layer is None else (b.mask >> layer) & 1):
            return None, b
        for peer, h in self.dir.entries.get(key, {}).items():
            if h.complete or (layer is not None and (h.mask >> layer) & 1):
                return peer, h
        return None

    def _satisfied(self, keys: list[bytes], layer: int | None) -> bool:
        return all(self.source(k, layer) is not None for k in keys)

    async def wait_ready(self, keys: list[bytes], layer: int | None, timeout: float) -> None:
        """Wait (on directory changes: no polling) until every key is readable with ``layer``.
        Raises TransferTimeout."""
        self.stats.layer_waits += 1
        try:
            async with asyncio.timeout(timeout):
                while not self._satisfied(keys, layer):
                    await self.dir.wait_changed()
        except TimeoutError:
            if not all(self.has(k) for k in keys):
                raise TransferTimeout(f"blocks did not appear within {timeout} s") from None
            what = f"layer {layer}" if layer is not None else "blocks"
            raise TransferTimeout(f"{what} not produced within {timeout} s") from None

    # -- put steps ----------------------------------------------------------------------------
    def filling(self, keys: list[bytes]) -> list[LocalBlock] | None:
        """A later layer of blocks this node is filling: their pool blocks, when every key is
        one (else None: ``reserve`` sorts them out)."""
        out = []
        for k in keys:
            b = self.pool.get(k)
            if b is None or b.complete:
                return None
            out.append(b)
        return out

    def snapshot_for_put(self, words: np.ndarray) -> None:
        """Nothing to snapshot: the pool and the directory are this loop's own dicts, read by
        ``reserve`` without an ``await`` in between."""
        return None

    async def reserve(self, kb: PutTxn, snap: None, timeout: float | None) -> list[int]:
        """Step 1 of a put: the positions of ``kb.keys`` it writes -- blocks this node is
        filling, and new slots for keys neither held here nor announced by a peer (those are
        skipped, counted in ``blocks_skipped``). Blocks evicted for room become the put's
        ``notices``. Raises RegionFull (the pool is full)."""
        keys = kb.keys
        todo: list[int] = []
        new: list[int] = []
        seen: set[bytes] = set()
        entries = self.dir.entries
        for i, k in enumerate(keys):
            b = self.pool.get(k)
            if b is not None and not b.complete:
                todo.append(i)
            elif b is not None or k in entries or k in seen:
                self.stats.blocks_skipped += 1
            else:
                new.append(i)
                seen.add(k)
        if new:
            _, evicted = self.pool.reserve([keys[i] for i in new])
            self.stats.evictions += len(evicted)
            self.stats.evictions_for_space += len(evicted)
            kb.notices = [evict_op(k, b) for k, b in evicted]
            todo = sorted(todo + new)
        return todo

    def reservations(self, keys: list[bytes], positions: list[int] | range) -> list[LocalBlock]:
        """The pool blocks of ``keys`` at ``positions`` (reserved or being filled)."""
        get = self.pool.get
        return [get(keys[i]) for i in positions]  # type: ignore[misc]

    def payload_offsets(self, res: list[LocalBlock]) -> np.ndarray:
        """The blocks' byte offsets in the pool tensor (int64)."""
        return np.array([b.slot for b in res], dtype=np.int64) * self.layout.block_bytes

    def publish(self, keys: list[bytes], positions: list[int] | range, res: list[LocalBlock],
                layer: int | None, nbytes: int, *, region_done: bool = False) -> int:
        """Step 3, once the copy has landed: the layers are in the pool (a later ``source``
        sees them), waiters wake. Returns the blocks written. The store announces them."""
        mask = self.pool.full_mask if layer is None else 1 << layer
        land = self.pool.land
        for i in positions:
            self.stats.blocks_stored += land(keys[i], mask).complete
        self.stats.bytes_put += nbytes
        self.stats.puts += 1
        self.dir.wake()
        return len(positions)

    def publish_early(self, res: list[LocalBlock], layer: int | None) -> bool:
        """No early half: the pool's marks are this loop's, set by ``publish``."""
        return False

    async def abandon(self, keys: list[bytes]) -> None:
        """Evict ``keys``' unfinished blocks (a put whose copy failed) and announce it; their
        earlier layers may have been announced already."""
        gone = []
        for k in keys:
            b = self.pool.get(k)
            if b is not None and not b.complete:
                gone.append((k, self.pool.evict(k)))
        if gone:
            self.stats.evictions += len(gone)
            self.dir.wake()
            await self._announce([evict_op(k, b) for k, b in gone if b is not None])

    # -- read steps ---------------------------------------------------------------------------
    async def prepare_read(self, keys: list[bytes], layer: int | None,
                           timeout: float | None) -> tuple[None, list[Source]]:
        """Steps 1-2 of a read: wait (``timeout`` > 0) until every key is readable, then each
        key's source. No ``await`` follows the lookup of the sources, so a local copy made right
        after it needs no check. Raises BlockNotFound, LayerNotReady, TransferTimeout."""
        if timeout is not None and timeout > 0:
            await self.wait_ready(keys, layer, timeout)
        n = len(keys)
        srcs = []
        for i, k in enumerate(keys):
            s = self.source(k, layer)
            if s is None:
                if not self.has(k):
                    self.stats.misses += 1
                    raise BlockNotFound(f"block {i} of {n} ({k[:8].hex()}…) is not in the region "
                                        f"nor announced by an HTTP peer (never stored, or evicted); "
                                        f"lookup() says how many leading blocks are resident")
                if layer is None:
                    raise LayerNotReady(f"block {i} ({k[:8].hex()}…) is still being produced; "
                                        f"pass timeout= to wait for it, or get it layer by layer")
                raise LayerNotReady(f"layer {layer} of block {i} ({k[:8].hex()}…) has not landed "
                                    f"yet; pass timeout= to wait for it")
            srcs.append(s)
        return None, srcs

    def validate_read(self, kb: Any, snap: list[Source], nbytes: int, *, cpu: bool = True,
                      layer: int | None = None) -> None:
        """Step 4, after every copy has landed: count the read and touch the local blocks for
        the LRU. Nothing to re-check here (see the module's table)."""
        n = len(kb.keys)
        st = self.stats
        st.gets += 1
        st.hits += n
        st.blocks_read += n
        st.bytes_got += nbytes
        touch = self.pool.touch
        for k, (peer, _) in zip(kb.keys, snap):
            if peer is None:
                touch(k)

    def would_consume(self, key: bytes, layer: int | None) -> bool:
        """Transfer mode: would reading ``layer`` (None: all) complete this node's read of
        ``key``? (A remote read asks its holder to consume the block during the check.)"""
        if layer is None:
            return True
        return (self._consumed_layers.get(key, 0) | (1 << layer)) == self.pool.full_mask

    def _consume_now(self, key: bytes, layer: int | None) -> bool:
        """Record that ``layer`` of ``key`` was read; True once every layer has been."""
        if layer is None:
            self._consumed_layers.pop(key, None)
            return True
        seen = self._consumed_layers.get(key, 0) | (1 << layer)
        if seen == self.pool.full_mask:
            self._consumed_layers.pop(key, None)
            return True
        self._consumed_layers[key] = seen
        return False

    def consumed_remote(self, keys: list[bytes], peer: str, layer: int | None) -> None:
        """Transfer mode, after a checked remote read of ``keys`` from ``peer``: record the
        layer; a key now read whole was consumed by its holder during the check: forget it."""
        for k in keys:
            if self._consume_now(k, layer):
                self.dir.forget(k, peer)
                self.stats.consumed += 1

    async def consume(self, kb: Any, snap: list[Source], layer: int | None) -> None:
        """Transfer mode's last step: evict the local blocks this node has now read whole and
        announce it (remote ones: ``consumed_remote``)."""
        done = [k for k, (peer, _) in zip(kb.keys, snap)
                if peer is None and self._consume_now(k, layer)]
        if not done:
            return
        gone = [(k, self.pool.evict(k)) for k in done]
        self.stats.consumed += len(gone)
        await self._announce([evict_op(k, b) for k, b in gone if b is not None])
