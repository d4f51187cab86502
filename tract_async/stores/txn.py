"""One put transaction and one read transaction: the protocol's steps, once, for every path.

Every put into the region and every read out of it, whatever moves its bytes -- the fused
kernel of a few CPU blocks, the loop's inline copy, the copy threads, a staged large put, the
parallel read groups, a CUDA DMA or its pinned fallback -- is one ``PutTxn`` or ``ReadTxn``.
The transaction holds what the steps share (the keys, their words, the layer, one absolute
deadline, the reservations or the snapshot) and runs the lifecycle's steps in the protocol's
order; a copy back-end only moves bytes between the addresses the transaction hands it and the
caller's tensors, and says when they have landed.

A put::

    txn = PutTxn(blocks, keys, layer, timeout, path="cpu")
    if not await txn.begin():      # the blocks this node is filling, or new reservations
        return 0                   # every key present already (counted as a put)
    plan = kvplan.plan(layout, txn.offsets(), txn.positions(), len(keys), layer)
    try:
        ... copy into the region by ``plan`` ...
    except BaseException:
        await txn.abandon()        # only once no byte of the copy can still land
        raise
    return txn.publish(nbytes)

A read::

    txn = ReadTxn(blocks, keys, layer, timeout, path="cpu")
    snap = await txn.prepare()     # waits (up to the deadline), checks state and bounds
    ... copy out of the region from ``snap[:, SNAP_POFF]`` ...
    txn.validate(nbytes)           # after the copy has landed: else BlockEvicted, a miss
    await txn.consume()            # transfer mode: free blocks read whole

The rules every path used to restate, and now states once:

- **Abandon only after the copy is settled.** ``abandon`` evicts this node's reservations of
  the put's keys; a path calls it only once its copy can no longer land (docs/design.md
  invariant 7).
- **One deadline.** ``timeout`` becomes an absolute ``Deadline`` at construction; a path that
  waited already (a parallel read's wait for its last key, a fused read's wait for READY)
  passes what is left (``txn.left()``) to the next step, instead of recomputing it by hand.
- **Consume in transfer mode**, after a validated read only.
- **Counted once**: a put that stores nothing counts as a put (``begin``); a fused put's or
  read's counters come from the lifecycle's fused steps.
- **Early copies** (``PutTxn.early``, ``EarlyCopies``): a copy back-end whose copies run
  asynchronously (the CUDA DMA) may start them between the slots' allocation and the index
  entries' placement, where a lock-free reservation of many new blocks allows it (docs/design.md,
  "Copies before the entries"); the reservation voids them (waits until they can no longer
  land) before it gives any of their slots back.

The steps themselves belong to a block lifecycle, the transaction's ``blocks``: the region's
(``stores/blocks.py``: the shared index, its lock and versions) or the HTTP store's
(``stores/poolsteps.py``: the local block pool and the directory of what peers announced). Both
offer what ``PutSteps`` and ``ReadSteps`` name; the fused one-call paths (``fused``) are the
region's alone.

``PutTxn.opened`` and ``ReadTxn.opened`` count transactions per path (a dict increment): the
test that every entry point constructs one reads them (``tests/engine/test_txn.py``).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from ..keys import KeyBatch, keys_to_words
from . import plan as kvplan
from .stats import TransferStats


class PutSteps(Protocol):
    """The steps a ``PutTxn`` runs, as a block lifecycle offers them (``BlockLifecycle``,
    ``PoolLifecycle``). ``Sequence[Any]``: the lifecycle's own reservations (``fillbook``
    rows, or pool blocks), which the transaction only carries from step to step."""
    stats: TransferStats

    def filling(self, keys: list[bytes]) -> Sequence[Any] | None: ...
    def snapshot_for_put(self, words: np.ndarray) -> Any: ...
    async def reserve(self, kb: Any, snap: Any, timeout: float | None) -> list[int]: ...
    def reservations(self, keys: list[bytes], positions: Any) -> Sequence[Any]: ...
    def payload_offsets(self, res: Any) -> np.ndarray: ...
    def publish(self, keys: list[bytes], positions: Any, res: Any, layer: int | None,
                nbytes: int, *, region_done: bool = False) -> int: ...
    def publish_early(self, res: Any, layer: int | None) -> bool: ...
    async def abandon(self, keys: list[bytes]) -> None: ...


class ReadSteps(Protocol):
    """The steps a ``ReadTxn`` runs (``BlockLifecycle``, ``PoolLifecycle``). The snapshot is
    the lifecycle's: index rows (an int64 array) or each key's source."""
    cfg: Any

    def read_words(self, keys: list[bytes]) -> np.ndarray: ...
    async def prepare_read(self, keys: list[bytes], layer: int | None,
                           timeout: float | None) -> tuple[np.ndarray | None, Any]: ...
    def validate_read(self, kb: Any, snap: Any, nbytes: int, *, cpu: bool = True,
                      layer: int | None = None) -> None: ...
    async def consume(self, kb: Any, snap: Any, layer: int | None) -> None: ...


class EarlyCopies(Protocol):
    """A put's copies started before its index entries are placed (``PutTxn.early``).

    The reserver calls ``start(offsets)`` once it holds every slot of a put whose keys are all
    new, with the payload offsets the keys will have in key order if the placement succeeds
    whole; ``start`` enqueues the copies (or nothing: ``started`` stays False). If the placement
    does not succeed whole, the reserver calls ``void()`` at once -- before it returns to the
    event loop, so before any freed slot can be taken again -- and ``void`` returns only when no
    byte of those copies can still land. The put's caller then copies again by what the
    reservation became (docs/design.md, "Copies before the entries")."""

    started: bool

    def start(self, offsets: np.ndarray) -> None: ...

    def void(self) -> None: ...


class _Deadline:
    """What a deadline does with its two words, ``at`` and ``timeout`` (``Deadline``), for
    the classes that hold them: a transaction keeps them among its own slots (it is its
    operation's key batch too, ``keys.KeyBatch``: one object per operation)."""
    __slots__ = ()
    at: float | None
    timeout: float | None

    def left(self) -> float | None:
        """The timeout for the next step: what is left of the deadline (at least 1 ms, so that
        a step that starts at the deadline still looks once and reports TransferTimeout
        rather than a miss), the original ``timeout`` when it allowed no waiting, or None."""
        if self.at is None:
            return self.timeout
        return max(1e-3, self.at - time.monotonic())

    def limit(self) -> float | None:
        """``left`` for a step that has a time limit but nothing to wait for (a network call):
        None, no limit, where the operation allowed no waiting (``timeout`` 0 or less only
        means "do not wait for the blocks") or had no timeout."""
        left = self.left()
        return left if left is not None and left > 0 else None


class Deadline(_Deadline):
    """An operation's one absolute deadline, from its ``timeout`` (seconds; None: none; 0 or
    less: no waiting at all). ``PutTxn`` and ``ReadTxn`` hold theirs the same way, in slots."""
    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.at = (time.monotonic() + timeout
                   if timeout is not None and timeout > 0 else None)


class PutTxn(KeyBatch, _Deadline):
    """One put of ``keys`` (``layer``, or every layer for None) through reserve -> copy ->
    publish, or abandon (module docstring). ``path`` names the copy back-end that moves its
    bytes (counted in ``opened``). It is the put's key batch (``keys.KeyBatch``): the steps
    it calls get the transaction itself, its words computed once (``key_words``)."""
    __slots__ = ("blocks", "layer", "todo", "res", "phases", "notices", "at", "timeout", "early")
    opened: ClassVar[Counter[str]] = Counter()

    def __init__(self, blocks: PutSteps, keys: list[bytes], layer: int | None,
                 timeout: float | None, path: str, *, words: np.ndarray | None = None,
                 phases: Any = None, early: EarlyCopies | None = None) -> None:
        self.blocks = blocks
        self.keys = keys
        self.layer = layer
        self.timeout = timeout          # Deadline's words, set here: one call less
        self.at = (time.monotonic() + timeout
                   if timeout is not None and timeout > 0 else None)
        self.words = words
        self.todo: list[int] | range = ()  # type: ignore[assignment]
        """The positions of ``keys`` this put writes (after ``begin``)."""
        self.res: Sequence[Any] = ()
        """Their reservations (after ``begin``)."""
        self.phases = phases
        self.notices: Sequence[list[Any]] = ()
        """What the lifecycle's ``reserve`` did that peers must hear of with the put (the HTTP
        pool: blocks evicted for room); empty on the region (a shared tuple: no list per put)."""
        self.early = early
        """Copies the reservation may start before the index entries (``EarlyCopies``)."""
        PutTxn.opened[path] += 1

    def key_words(self) -> np.ndarray:
        """The keys' index words (computed once)."""
        w = self.words
        if w is None:
            w = self.words = keys_to_words(self.keys)
        return w

    def fused(self, src: int, tmpl: np.ndarray) -> int | None:
        """The whole put in one kernel call from private memory at ``src`` (a few whole blocks:
        ``BlockLifecycle.put_fused``); None: nothing done, take the step-by-step path."""
        if self.words is None:
            self.key_words()
        return self.blocks.put_fused(self, src, tmpl)  # type: ignore[attr-defined]

    def resume(self) -> bool:
        """A later layer of blocks this node is filling: their reservations from the book,
        without the index, the lock or the key words. False when some key is not in flight
        (``begin`` then reserves)."""
        res = self.blocks.filling(self.keys) if self.layer is not None else None
        if res is None:
            return False
        self.todo, self.res = range(len(self.keys)), res
        return True

    async def begin(self, *, count_empty: bool = True) -> bool:
        """Step 1: the blocks to write -- this node's in-flight reservations of a later layer
        (``resume``), else a reservation of the keys absent from the index. False when there is
        nothing to write (every key present already: counted as a put, unless ``count_empty``
        is False: a stage of a larger put, which counts once)."""
        b, ph = self.blocks, self.phases
        t0 = time.perf_counter_ns() if ph is not None else 0
        if self.resume():
            if ph is not None:
                ph.add("reserve_incl_lock", t0)
            return True
        words = self.key_words()
        snap = b.snapshot_for_put(words)
        if ph is not None:
            ph.add("snapshot", t0)
            t0 = time.perf_counter_ns()
        todo = await b.reserve(self, snap, self.left())
        if ph is not None:
            ph.add("reserve_incl_lock", t0)
        if not todo:
            if count_empty:
                b.stats.puts += 1
            return False
        self.todo, self.res = todo, b.reservations(self.keys, todo)
        return True

    def offsets(self) -> np.ndarray:
        """The payload offsets of the blocks to write, in ``todo`` order."""
        return self.blocks.payload_offsets(self.res)

    def positions(self) -> np.ndarray:
        """``todo`` as block positions in the caller's tensor (int64, read-only)."""
        return kvplan.positions(self.todo, len(self.keys))

    def whole(self) -> bool:
        """Every key is written by this put (none was present already)."""
        return len(self.todo) == len(self.keys)

    def publish(self, nbytes: int, *, region_done: bool = False) -> int:
        """Step 3, once the copy has landed: the layer bits (READY after the last layer);
        ``region_done``: ``publish_early`` stored them already. Returns the blocks published."""
        return self.blocks.publish(self.keys, self.todo, self.res, self.layer, nbytes,
                                   region_done=region_done)

    def publish_early(self) -> bool:
        """The on-region half of ``publish`` from any thread (``BlockLifecycle.publish_early``):
        False when this put's reservations are not one whole batch."""
        return self.blocks.publish_early(self.res, self.layer)

    async def abandon(self) -> None:
        """Evict this put's reservations; only once none of its copies can still land."""
        todo, keys = self.todo, self.keys
        await self.blocks.abandon(keys if len(todo) == len(keys) else [keys[i] for i in todo])


def publish_stages(stages: Sequence[tuple[PutTxn, int]]) -> int:
    """Step 3 of a put taken in stages (``stores/region.py``, "Staged large puts"), once the
    last stage's copy has landed: every stage
    published, in order (no block is READY before all are in memory), ``(stage, its bytes)``;
    the put counts once, however many stages. Returns the blocks published."""
    done = sum(st.publish(nbytes) for st, nbytes in stages)
    if stages:
        stages[0][0].blocks.stats.puts -= len(stages) - 1
    return done


class ReadTxn(KeyBatch, _Deadline):
    """One read of ``keys`` (``layer``, or every layer for None) through prepare -> copy ->
    validate -> consume (module docstring). ``path`` names the copy back-end (``opened``).
    Like ``PutTxn``, it is the read's key batch."""
    __slots__ = ("blocks", "layer", "snap", "at", "timeout")
    opened: ClassVar[Counter[str]] = Counter()

    def __init__(self, blocks: ReadSteps, keys: list[bytes], layer: int | None,
                 timeout: float | None, path: str, *, words: np.ndarray | None = None) -> None:
        self.blocks = blocks
        self.keys = keys
        self.layer = layer
        self.timeout = timeout
        self.at = (time.monotonic() + timeout
                   if timeout is not None and timeout > 0 else None)
        self.words = words
        self.snap: Any = None
        """What the copy reads by (after ``prepare``, or a fused or parallel read): the region's
        index rows (int64), or the HTTP pool's source of each key."""
        ReadTxn.opened[path] += 1

    def key_words(self) -> np.ndarray:
        """The keys' index words (``BlockLifecycle.read_words``: cached across layers)."""
        w = self.words
        if w is None:
            w = self.words = self.blocks.read_words(self.keys)
        return w

    def fused(self, dst: int, tmpl: np.ndarray) -> bool:
        """The whole read in one kernel call into private memory at ``dst`` (a few READY
        blocks: ``BlockLifecycle.get_fused``, validated and counted there). False: nothing
        copied (some block absent or not READY)."""
        b = self.blocks
        if self.words is None:
            self.key_words()
        snap = b.get_fused(self, dst, tmpl)
        if snap is None:
            return False
        # the lifecycle's scratch rows are valid until its next fused call: transfer mode
        # keeps them across the await of ``consume``
        self.snap = snap.copy() if b.cfg.mode == "transfer" else snap
        return True

    async def fused_waiting(self, dst: int, tmpl: np.ndarray) -> bool:
        """``fused``, and when the blocks were not all READY and the deadline allows waiting:
        wait for them (``BlockLifecycle.wait_whole``) and try once more. After a wait the
        step-by-step path gets no further waiting (it reports what is missing)."""
        if self.fused(dst, tmpl):
            return True
        if self.at is None:
            return False
        b = self.blocks
        n = len(self.keys)
        await b.wait_whole(self.key_words(), b.fused_snapshot(n), self.left())
        self.at = self.timeout = None
        return self.fused(dst, tmpl)

    async def prepare(self) -> np.ndarray:
        """Steps 1-2: the snapshot the copy reads by, after waiting (up to the deadline) for
        the blocks or the layer; checks state, bounds and namespace."""
        words, snap = await self.blocks.prepare_read(self.keys, self.layer, self.left())
        self.words, self.snap = words, snap
        return snap

    def prepare_known(self, rows: np.ndarray) -> bool:
        """Steps 1-2 of a later layer by the snapshot its first layer took (a CUDA layer
        stream; the region's lifecycle only): False, nothing prepared, when some block is not
        fine for this layer yet (``prepare`` then waits or raises). The words must be set."""
        snap = self.blocks.prepare_known(rows, self.layer)  # type: ignore[attr-defined]
        if snap is None:
            return False
        self.snap = snap
        return True

    def prepare_seen(self, rows: np.ndarray) -> None:
        """Steps 1-2 of a later layer that a validated read by ``rows`` saw in for every block
        (a CUDA layer stream's, ``cuda/layerstream.py``, "Seen layers"): nothing to look at;
        this read's validation, after its copy, checks that the versions still hold."""
        self.blocks.read_seen()  # type: ignore[attr-defined]
        self.snap = rows

    def took(self, snap: np.ndarray) -> None:
        """A back-end that snapshotted and validated by itself (the parallel groups) hands its
        snapshot over for ``consume``."""
        self.snap = snap

    def validate(self, nbytes: int, *, cpu: bool = True) -> None:
        """Step 4, after the copy has landed (on a GPU: after its DMA): every block still the
        one snapshotted, else BlockEvicted (a miss). ``cpu``: this host's CPU read the bytes."""
        assert self.snap is not None
        self.blocks.validate_read(self, self.snap, nbytes, cpu=cpu, layer=self.layer)

    async def consume(self) -> None:
        """Transfer mode: free the blocks once read whole (after a validated read only)."""
        b = self.blocks
        if b.cfg.mode != "transfer":
            return
        assert self.snap is not None
        await b.consume(self, self.snap, self.layer)
