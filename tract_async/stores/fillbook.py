"""This node's blocks in flight: the reservations a put fills layer by layer, until READY.

A put reserves index entries and payload slots (``stores/reservation.py``), copies layers in,
and publishes them (``stores/blocks.py``); between those steps the reservations live here, each
key mapped to its ``Reservation`` -- or, for a large put, to the one ``FillBatch`` that stands
for all of its keys. A later layer's put finds its reservations here without the index
(``filling``); an abandon takes them back out (``pop``); the chunk giver asks which chunks
hold them (``busy_chunks``). The book holds no region state: its keys, slots and offsets are
this node's own record of what it wrote there.

Why a module of its own (issue 37): the bookkeeping was spread over twelve methods of the
block lifecycle, read by the reservation, publication, abandon and close steps alike.
"""
from __future__ import annotations

import threading
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np

_OFFSET_OF = attrgetter("offset")

class FillBatch:
    """The blocks one ``Reserver.place`` call reserved, as arrays: while they are filled layer by
    layer, every one of their keys maps to this object in ``FillBook`` (it
    stands for all of them) and it is the handle ``reservations`` and ``filling`` return for a
    transfer of exactly its keys, in order.

    Why. A put of n new blocks used to make n ``Reservation`` objects under its reservation
    (0.15 µs each on the 2-core VM: 308 µs of a 2048-block put's ~1.3 ms ``_place``, and 2-3x
    that on the H200 host, where the first layer of a layer-streamed 128 MiB handoff waits for
    it), and each later layer put looked each one up and compared it (``filling``, ``publish``:
    ~100 µs a 2048-block layer). The arrays serve the common shape -- every layer put for the
    same keys in the same order -- with one list comparison per layer.

    Any other shape (a subset of the keys, another order, an abandon, an undo) first *splits*
    the batch (``FillBook.split_keys``): a ``Reservation`` per key, with the layers published
    so far, replaces the batch in the book; ``members`` keeps them in key order and
    ``whole`` turns False, so the arrays never serve again. A transfer holding the batch as its
    handle while that happened (a copy in flight when another task abandoned some of its keys)
    then publishes through ``members``, key by key, as for any list of reservations."""
    __slots__ = ("keys", "slots", "versions", "offsets", "chunks", "lines", "layers_lo",
                 "layers_hi", "whole", "members")

    def __init__(self, keys: list[bytes], slots: np.ndarray, versions: np.ndarray,
                 offsets: np.ndarray, chunks: np.ndarray, lines: np.ndarray) -> None:
        self.keys = keys
        self.slots = slots
        self.versions = versions
        self.offsets = offsets
        self.chunks = chunks
        self.lines = lines
        """The words each entry held when reserved, a row an entry (``index.reserve_batch_counted``):
        a layer's publish writes whole lines from them (``index.publish_layers_lines``)."""
        self.layers_lo = 0
        self.layers_hi = 0
        self.whole = True
        """Every key of ``keys`` maps to this batch in the book (until a split or the
        publish of its last layer)."""
        self.members: list["Reservation"] | None = None
        """The reservations a split made, in key order (None before a split)."""

    def __len__(self) -> int:
        return len(self.keys)


class Reservation:
    """A block this node reserved and is filling, layer by layer, apart from any batch: its
    index entry (``slot``, ``version``), its payload (``offset``: bytes from the region base, in
    chunk ``chunk``), and the layers published so far. (A slotted class; a large put's blocks
    are a ``FillBatch`` instead. It keeps the payload's place, not its ``Allocation``: a
    reservation is undone through its index entry, whose payload words say what to free.)"""
    __slots__ = ("slot", "version", "offset", "chunk", "layers_lo", "layers_hi")

    def __init__(self, slot: int, version: int, offset: int, chunk: int, layers_lo: int = 0,
                 layers_hi: int = 0) -> None:
        self.slot = slot
        self.version = version
        self.offset = offset
        self.chunk = chunk
        self.layers_lo = layers_lo
        self.layers_hi = layers_hi


Reserved = FillBatch | list[Reservation]
"""What ``reservations`` and ``filling`` return and ``payload_offsets`` / ``publish`` take:
a whole batch, or one reservation per position."""




class FillBook:
    """Each in-flight key's ``Reservation`` or ``FillBatch`` (module docstring). Used from the
    event loop, except ``publish_early``'s reads of a batch under ``pub_lock``."""

    def __init__(self) -> None:
        self.reserved: dict[bytes, Reservation | FillBatch] = {}
        """This node's blocks in flight: each key's reservation, or the batch that holds it."""
        self.pub_lock = threading.Lock()
        """Guards a FillBatch's layer record and ``whole`` flag against ``publish_early``
        (another thread: ``BlockLifecycle.publish_early`` says why)."""

    def __len__(self) -> int:
        return len(self.reserved)

    def __bool__(self) -> bool:
        return bool(self.reserved)

    def __contains__(self, key: bytes) -> bool:
        return key in self.reserved

    def pop(self, keys: list[bytes]) -> list[tuple[bytes, Reservation]]:
        """Take this node's reservations of ``keys`` out of the book (an abandon): each key
        with its own Reservation (any batch among them split first)."""
        self.split_keys(keys)
        reserved = self.reserved
        return [(k, reserved.pop(k)) for k in keys if k in reserved]

    def any_of(self, keys: list[bytes]) -> bool:
        """Whether one of ``keys`` is in flight."""
        reserved = self.reserved
        return bool(reserved) and any(k in reserved for k in keys)

    def filling(self, keys: list[bytes]) -> Reserved | None:
        """This node's reservations of ``keys``, in order, when each key is a block this node
        is filling (reserved by an earlier layer's put, not yet READY): what ``reserve`` and
        ``reservations`` would give for them, found without the index snapshot (and the key
        words) they need for other keys -- the whole ``FillBatch`` when ``keys`` are exactly
        its keys (one list comparison). None otherwise."""
        reserved = self.reserved
        if not keys or len(reserved) < len(keys):
            return None
        whole = self.batch_of(keys)
        if whole is not None:
            return whole
        try:
            return self.as_reservations(keys, list(map(reserved.__getitem__, keys)))
        except KeyError:
            return None

    def batch_of(self, keys: list[bytes]) -> FillBatch | None:
        """The whole FillBatch whose keys are exactly ``keys`` (same order), or None."""
        b = self.reserved.get(keys[0])
        if type(b) is FillBatch and b.whole and (b.keys is keys or b.keys == keys):
            return b
        return None

    def as_reservations(self, keys: list[bytes], vals: list[Any]) -> list[Reservation]:
        """``vals`` (the ``reserved`` values of ``keys``) as one Reservation per key: any
        batch among them is split first (``FillBatch``). A C-level type scan when none is."""
        if FillBatch not in map(type, vals):
            return vals
        self.split_keys(keys)
        return list(map(self.reserved.__getitem__, keys))

    def split_keys(self, keys: list[bytes]) -> None:
        """Split every FillBatch that one of ``keys`` maps to (``FillBatch``: a Reservation per
        key, with the layers published so far, replaces it)."""
        reserved = self.reserved
        seen: dict[int, FillBatch] = {}
        for k in keys:
            v = reserved.get(k)
            if type(v) is FillBatch:
                seen[id(v)] = v
        for b in seen.values():
            with self.pub_lock:          # its layers are final while ``publish_early`` waits
                if not b.whole:
                    continue
                members = list(map(Reservation, b.slots.tolist(), b.versions.tolist(),
                                   b.offsets.tolist(), b.chunks.tolist(), repeat(b.layers_lo),
                                   repeat(b.layers_hi)))
                reserved.update(zip(b.keys, members))
                b.members = members
                b.whole = False

    def in_flight(self) -> list[Reservation | FillBatch]:
        """The distinct values of ``reserved`` (a batch once, however many keys it holds)."""
        return list({id(v): v for v in self.reserved.values()}.values())

    def reservations(self, keys: list[bytes], positions: list[int]) -> Reserved:
        """This node's reservations of ``keys[i]`` for ``i`` in ``positions`` (from ``Reserver.reserve``):
        the whole FillBatch when they are exactly its keys, else one Reservation each."""
        reserved = self.reserved
        if len(positions) == len(keys):     # every key (positions ascend)
            whole = self.batch_of(keys) if keys else None
            if whole is not None:
                return whole
            return self.as_reservations(keys, list(map(reserved.__getitem__, keys)))
        ks = [keys[i] for i in positions]
        return self.as_reservations(ks, list(map(reserved.__getitem__, ks)))

    @staticmethod
    def payload_offsets(res: Reserved) -> np.ndarray:
        """int64 payload offsets of ``res``, in order."""
        if type(res) is FillBatch:
            return res.offsets
        return np.fromiter(map(_OFFSET_OF, res), dtype=np.int64, count=len(res))

    def busy_chunks(self) -> set[int]:
        """The chunks of this node's puts in flight."""
        busy: set[int] = set()
        for v in self.in_flight():
            busy.update(v.chunks.tolist() if type(v) is FillBatch else (v.chunk,))
        return busy
