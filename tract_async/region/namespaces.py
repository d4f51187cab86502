"""Namespace records: the KV layout of every namespace that stores blocks in the region.

Why. A block is bytes at an offset; what they mean (how many layers, heads, which dtype) is the
producer's ``KVLayout``, which the index entry never said. Keys fold the namespace in (model,
layout, rank: ``keys.py``), so two namespaces never compute the same key by accident -- but a
key is 32 bytes that any process can pass to any engine (a router forwarding another model's
keys, a test, ``vllm_compatible_keys``, whose keys leave the namespace out), and an engine given
another namespace's key read that block with *its own* layout: the other model's bytes as its
tensor, with no error when the block sizes agreed, and a misleading ``BlockEvicted`` ("changed
during the read") when they did not. So the layout is part of the region's contract:

* **One record per namespace** (``layout.NAMESPACE``, section ``"namespaces"``): identity
  (a hash of the namespace name, rank and world size) and the layout. An engine records its
  namespace when it opens, under the global lock, unless a record of that identity is there;
  one that is there with another layout refuses the engine's open (``LayoutMismatch``).
* **Every index entry names its record**: the producer stores its record's tag (slot + 1) in
  bits 32..47 of the entry's ``flags`` word (``layout.INDEX_FLAG_NS_SHIFT``), written with the
  rest of line 1 by the reservation, before the entry is published. A reader compares the tag it
  snapshots with its own; a foreign tag sends it to this table, and a record of another layout
  makes the read a ``LayoutMismatch`` naming both layouts (``stores/layouts.py``). Tag 0 means
  "written by no engine" (index tools and tests that reserve directly) and is not checked.

Why per namespace and not per block: a block would need the whole layout in its entry (two more
words in a full 128-byte entry, or a digest that could not be named in a message), while the
number of namespaces in a rack is tiny; a tag of 16 bits in a word the entry already has costs
nothing on the put path, and the read path's check is one compare of a word it already reads.

Who writes what, and in what order. Records are written only by a node holding the global lock
(``record`` takes a ``holding_lock`` acknowledgement: the lock lives in ``sync``, above this
layer), into the first EMPTY slot, and never rewritten or freed: entries may name a record long
after its engines left, and slots fill in order, so a scan stops at the first EMPTY slot. A
record's words are cached stores; then both lines are flushed (``namespaces.record.flush``),
fenced, and ``state = READY`` is stored and flushed last (``namespaces.state.flush``): a reader
that sees READY sees the layout too. Readers take no lock: they invalidate both lines
(``namespaces.read.invalidate``) and use a record only when it is READY; a READY record is
immutable. A record is published before any entry carries its tag (the engine records at open,
before its first put), so a tag always names a READY record on an undamaged region.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np

import tract_kernels as K

from ..errors import NamespaceTableFull, RegionCorrupt
from . import layout as L
from .memview import MemView

SECTION = "namespaces"
S_NS_WRITE = K.site("namespaces.record.flush")
S_NS_STATE = K.site("namespaces.state.flush")
S_NS_READ = K.site("namespaces.read.invalidate")

RECORD_BYTES = L.NAMESPACE.itemsize
_STATE_OFFSET = L.NAMESPACE.dtype.fields["state"][1]


def section_bytes(slots: int = L.NAMESPACE_SLOTS) -> int:
    """Bytes of the namespaces section for ``slots`` records, whole pages."""
    return L.align_up(slots * RECORD_BYTES, L.PAGE_BYTES)


def namespace_id(name: str, rank: int, world_size: int) -> int:
    """The identity of a namespace in a record: 64 bits of SHA-256, never 0 (0 is EMPTY)."""
    raw = hashlib.sha256(f"tract-namespace-v1\0{name}\0{rank}\0{world_size}".encode()).digest()
    return int.from_bytes(raw[:8], "little") or 1


def ns_tag_of(flags: int) -> int:
    """The namespace tag held in an index entry's ``flags`` word (0: none)."""
    return (int(flags) >> L.INDEX_FLAG_NS_SHIFT) & L.INDEX_FLAG_NS_MASK


def ns_flags(tag: int) -> int:
    """The ``flags`` bits that carry namespace tag ``tag``."""
    if not 0 <= tag <= L.INDEX_FLAG_NS_MASK:
        raise ValueError(f"a namespace tag is in 0..{L.INDEX_FLAG_NS_MASK}, got {tag}")
    return tag << L.INDEX_FLAG_NS_SHIFT


@dataclass(frozen=True, kw_only=True)
class NamespaceLayout:
    """What a record says: a namespace (name, rank, world size) and its KV layout, in plain
    values (this layer knows no ``KVLayout``)."""
    name: str
    rank: int
    world_size: int
    num_layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_bytes: int

    @property
    def ns_id(self) -> int:
        return namespace_id(self.name, self.rank, self.world_size)

    def geometry(self) -> tuple[int, int, int, int, str, int]:
        """What must agree for two namespaces' blocks to mean the same bytes."""
        return (self.num_layers, self.block_tokens, self.kv_heads, self.head_dim, self.dtype,
                self.block_bytes)

    def describe(self) -> str:
        """The layout and whose it is, for messages."""
        who = f"namespace {self.name!r}" + (f" rank {self.rank}/{self.world_size}"
                                             if self.world_size != 1 or self.rank else "")
        return (f"{who}: KVLayout(num_layers={self.num_layers}, block_tokens="
                f"{self.block_tokens}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype!r}), {self.block_bytes} bytes a block")


@dataclass(frozen=True, kw_only=True)
class NamespaceRecord:
    """A READY record: where it is, its tag, what it says, who wrote it when. ``ns_id`` is the
    stored identity (the stored name may be cut: ``layout.ns_id`` need not equal it)."""
    slot_index: int
    ns_id: int
    layout: NamespaceLayout
    recorded_by: int
    recorded_ns: int

    @property
    def tag(self) -> int:
        """What entries stored under this namespace carry in their ``flags`` (slot + 1)."""
        return self.slot_index + 1


def _cut_utf8(text: str, nbytes: int) -> bytes:
    """``text`` as UTF-8, cut to at most ``nbytes`` bytes on a character boundary."""
    raw = text.encode("utf-8")
    if len(raw) <= nbytes:
        return raw
    return raw[:nbytes].decode("utf-8", "ignore").encode("utf-8")


class NamespaceTable:
    """The records of one region (module docstring). Build with ``NamespaceTable.of(region)``."""

    def __init__(self, view: MemView, *, path: str, offset_bytes: int, slots: int) -> None:
        """``view``: the region, for its memory (read on every access: ``memview``); ``path``:
        for messages; ``offset_bytes``, ``slots``: where the records lie and how many."""
        self._view = view
        self._path = path
        self._offset = offset_bytes
        self.slots = slots

    @classmethod
    def of(cls, region) -> "NamespaceTable":  # noqa: ANN001 (a Region: region.py imports us)
        """The table of ``region``. Raises RootNameNotFound (a region without the section)."""
        sec = region.section(SECTION)
        return cls(region, path=region.path, offset_bytes=sec.offset_bytes,
                   slots=min(L.NAMESPACE_SLOTS, sec.nbytes // RECORD_BYTES))

    def _slot_offset(self, slot_index: int) -> int:
        return self._offset + slot_index * RECORD_BYTES

    def read(self, slot_index: int) -> NamespaceRecord | None:
        """The record in ``slot_index`` as memory holds it now; None while it is not READY."""
        raw = np.zeros(RECORD_BYTES, dtype=np.uint8)
        K.read_bytes(self._view.mem, self._slot_offset(slot_index), raw.ctypes.data, raw.size,
                     S_NS_READ)
        rec = raw.view(L.NAMESPACE.dtype)[0]
        if int(rec["state"]) != L.NS_READY:
            return None
        lay = NamespaceLayout(
            name=bytes(rec["name"]).rstrip(b"\0").decode("utf-8", "replace"),
            rank=int(rec["rank"]), world_size=int(rec["world_size"]),
            num_layers=int(rec["num_layers"]), block_tokens=int(rec["block_tokens"]),
            kv_heads=int(rec["kv_heads"]), head_dim=int(rec["head_dim"]),
            dtype=bytes(rec["dtype"]).rstrip(b"\0").decode("ascii", "replace"),
            block_bytes=int(rec["block_bytes"]))
        return NamespaceRecord(slot_index=slot_index, ns_id=int(rec["ns_id"]), layout=lay,
                               recorded_by=int(rec["recorded_by"]),
                               recorded_ns=int(rec["recorded_ns"]))

    def records(self) -> list[NamespaceRecord]:
        """Every READY record, in slot order (they fill from slot 0: the scan stops at the
        first EMPTY one). Takes no lock."""
        out = []
        for i in range(self.slots):
            rec = self.read(i)
            if rec is None:
                break
            out.append(rec)
        return out

    def _find(self, ns_id: int) -> tuple[NamespaceRecord | None, int]:
        """(the record of ``ns_id`` or None, the first EMPTY slot or -1)."""
        for i in range(self.slots):
            rec = self.read(i)
            if rec is None:
                return None, i
            if rec.ns_id == ns_id:
                return rec, -1
        return None, -1

    def find(self, ns_id: int) -> NamespaceRecord | None:
        """The READY record of the namespace ``ns_id``, or None. Takes no lock."""
        return self._find(ns_id)[0]

    def by_tag(self, tag: int) -> NamespaceRecord:
        """The record an entry's tag names. Raises RegionCorrupt when it names none (a record
        is READY before any entry carries its tag: module docstring)."""
        rec = self.read(tag - 1) if 1 <= tag <= self.slots else None
        if rec is None:
            raise RegionCorrupt(f"{self._path}: an index entry names namespace record {tag - 1}, "
                                f"which is not recorded (of {self.slots}): the region is damaged")
        return rec

    def record(self, lay: NamespaceLayout, *, node_id: int,
               holding_lock: bool) -> NamespaceRecord:
        """The record of ``lay``'s namespace: the one there (whatever its layout: the caller
        compares), else a new one in the first EMPTY slot. The caller must hold the global lock.

        Raises NamespaceTableFull, ValueError (``holding_lock`` false).
        """
        if not holding_lock:
            raise ValueError("NamespaceTable.record needs the global lock: call it while holding "
                             "it and pass holding_lock=True")
        found, free = self._find(lay.ns_id)
        if found is not None:
            return found
        if free < 0:
            raise NamespaceTableFull(
                f"{self._path}: all {self.slots} namespace records are taken; namespace "
                f"{lay.name!r} (rank {lay.rank}) cannot be recorded: use another region for it")
        now = time.time_ns()
        rec = np.zeros(1, dtype=L.NAMESPACE.dtype)
        rec["ns_id"] = lay.ns_id
        rec["rank"], rec["world_size"] = lay.rank, lay.world_size
        rec["name"] = _cut_utf8(lay.name, L.NAMESPACE_NAME_BYTES)
        rec["recorded_by"] = node_id
        rec["state"] = L.NS_EMPTY
        rec["num_layers"], rec["block_tokens"] = lay.num_layers, lay.block_tokens
        rec["kv_heads"], rec["head_dim"] = lay.kv_heads, lay.head_dim
        rec["block_bytes"] = lay.block_bytes
        rec["dtype"] = lay.dtype.encode("ascii")[:L.NAMESPACE_DTYPE_BYTES]
        rec["recorded_ns"] = now
        words = rec.view(np.uint64)
        mem = self._view.mem
        off = self._slot_offset(free)
        # every field (state still EMPTY) with cached stores, both lines flushed; then READY
        for w in range(RECORD_BYTES // 8):
            K.store(mem, off + 8 * w, words[w])
        K.flush_range(mem, off, RECORD_BYTES, S_NS_WRITE)
        K.store_fence(mem)
        K.store_flush(mem, off + _STATE_OFFSET, L.NS_READY, S_NS_STATE)
        return NamespaceRecord(slot_index=free, ns_id=lay.ns_id, layout=lay, recorded_by=node_id,
                               recorded_ns=now)
