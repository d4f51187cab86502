"""The root directory: name -> (offset, size, kind) of the region's root objects.

This is the paper's shared object store in miniature: every node finds the lock table, the
allocator and the index by name here, never by a pointer. Layout: ``layout.ROOT_ENTRY``.

Writers: the creator while the region is INITIALIZING, afterwards only a node holding the global
lock (``publish`` takes a ``holding_lock`` acknowledgement: the lock lives in ``sync``, above this
layer). Publish order: name, offset, nbytes, kind, flush the line, then state = READY, flush.
Readers take no lock: invalidate the line, read state; READY entries are immutable.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import tract_kernels as K

from ..errors import RegionCorrupt, RootDirectoryFull, RootNameInvalid, RootNameNotFound
from . import layout as L
from .memview import MemView

S_ROOT_WRITE = K.site("rootdir.entry.flush")
S_ROOT_STATE = K.site("rootdir.state.flush")
S_ROOT_READ = K.site("rootdir.read.invalidate")


@dataclass(frozen=True, kw_only=True)
class RootEntry:
    """One published root object."""
    name: str
    offset_bytes: int
    nbytes: int
    kind: int
    slot_index: int


def _encode(name: str) -> bytes:
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise RootNameInvalid(f"root name {name!r} is not valid UTF-8") from None
    if not raw or len(raw) > L.ROOT_NAME_BYTES or b"\0" in raw:
        raise RootNameInvalid(f"root name {name!r}: expected 1..{L.ROOT_NAME_BYTES} UTF-8 bytes "
                              f"without NUL, got {len(raw)} bytes")
    return raw


class RootDirectory:
    """Name -> offset table in the region. Obtained as ``region.root``."""

    def __init__(self, view: MemView, *, path: str, offset_bytes: int, slots: int,
                 region_bytes: int) -> None:
        """``view``: the region, for its memory (read on every access: ``memview``); ``path``:
        for messages; ``offset_bytes``, ``slots``: where the directory lies and its entry count;
        ``region_bytes``: the bound on what an entry may point at (all from the header)."""
        self._view = view
        self._path = path
        self._offset = offset_bytes
        self._slots = slots
        self._region_bytes = region_bytes

    def _slot_offset(self, slot_index: int) -> int:
        return self._offset + slot_index * L.ROOT_ENTRY.itemsize

    def _read_table(self) -> np.ndarray:
        """Every slot's record, as memory holds it now, in one read of the whole table.

        One kernel call for the table: a call per slot (64 of them, ~15 µs each with the record
        decoding) made each ``entries()`` ~1 ms, and an attach looks sections up by name ~25
        times (the fuzzed-attach tests spent 40 % of their time here)."""
        raw = np.zeros(self._slots * L.ROOT_ENTRY.itemsize, dtype=np.uint8)
        K.read_bytes(self._view.mem, self._offset, raw.ctypes.data, raw.size, S_ROOT_READ)
        return raw.view(L.ROOT_ENTRY.dtype)

    def entries(self) -> list[RootEntry]:
        """Every READY entry, in slot order. Takes no lock."""
        # states first, then the records again: a record copied in one pass could show a READY
        # state written after the copy read its other fields (a publish racing the read; loads
        # are not reordered with loads, so the second copy holds every field written before the
        # READY that the first one saw)
        ready = np.flatnonzero(self._read_table()["state"] == L.ROOT_READY)
        if ready.size == 0:
            return []
        table = self._read_table()
        out = []
        for i in ready.tolist():
            rec = table[i]
            off, nb = int(rec["offset_bytes"]), int(rec["nbytes"])
            name = bytes(rec["name"]).rstrip(b"\0").decode("utf-8", "replace")
            # every section is read through these bounds by jitted kernels that do not check
            # them again: an entry pointing past the region would be a wild read (a fuzzed
            # root directory segfaulted PrefixIndex before this check)
            if off + nb > self._region_bytes or off % L.LINE_BYTES:
                raise RegionCorrupt(f"{self._path}: root object {name!r} (slot {i}) at "
                                    f"[{off}, {off + nb}) lies outside the region "
                                    f"(0..{self._region_bytes}) or is not line-aligned: the root "
                                    f"directory is damaged")
            out.append(RootEntry(name=name, offset_bytes=off, nbytes=nb,
                                 kind=int(rec["kind"]), slot_index=i))
        return out

    def lookup(self, name: str) -> RootEntry:
        """The entry published under ``name``. Raises RootNameNotFound, RootNameInvalid."""
        _encode(name)
        for e in self.entries():
            if e.name == name:
                return e
        raise RootNameNotFound(f"no root object named {name!r} in {self._path} "
                               f"(published: {[e.name for e in self.entries()]})")

    def publish(self, name: str, offset_bytes: int, nbytes: int, kind: int = 0, *,
                holding_lock: bool) -> RootEntry:
        """Publish a new root object. The caller must hold the global lock.

        Raises RootNameInvalid, RootDirectoryFull, ValueError (name taken, bounds, or
        ``holding_lock`` false).
        """
        if not holding_lock:
            raise ValueError("RootDirectory.publish needs the global lock: call it while holding "
                             "it and pass holding_lock=True")
        return self.publish_unlocked(name, offset_bytes, nbytes, kind)

    def publish_unlocked(self, name: str, offset_bytes: int, nbytes: int, kind: int) -> RootEntry:
        raw_name = _encode(name)
        size = self._region_bytes
        if offset_bytes < 0 or nbytes < 0 or offset_bytes + nbytes > size:
            raise ValueError(f"root object {name!r} [{offset_bytes}, {offset_bytes + nbytes}) is "
                             f"outside the region (0..{size})")
        free = None
        table = self._read_table()        # the lock holder's view: no publish races it
        for i in range(self._slots):
            rec = table[i]
            if int(rec["state"]) == L.ROOT_READY:
                if bytes(rec["name"]).rstrip(b"\0") == raw_name:
                    raise ValueError(f"root name {name!r} is already published")
            elif free is None:
                free = i
        if free is None:
            raise RootDirectoryFull(f"all {self._slots} root-directory slots are in use")
        mem = self._view.mem
        rec = np.zeros(1, dtype=L.ROOT_ENTRY.dtype)
        rec["name"] = raw_name
        rec["offset_bytes"] = offset_bytes
        rec["nbytes"] = nbytes
        rec["kind"] = kind
        rec["state"] = L.ROOT_EMPTY
        body = rec.view(np.uint8)
        off = self._slot_offset(free)
        # fields first (state still EMPTY), flushed; then READY, flushed
        K.write_bytes(mem, off, body.ctypes.data, 56, S_ROOT_WRITE)
        K.flush(mem, off, S_ROOT_WRITE)
        K.store_fence(mem)
        K.store_flush(mem, off + 56, L.ROOT_READY, S_ROOT_STATE)
        return RootEntry(name=name, offset_bytes=offset_bytes, nbytes=nbytes, kind=kind,
                         slot_index=free)
