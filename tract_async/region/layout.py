"""Byte layout of every on-region structure: tables, numpy dtypes, and the layout signature.

Every structure stored in the region is described twice, on purpose: a human table (offset,
size, type, field, writer) that documents who may write each word, and a numpy dtype the code
uses. ``tests/test_layout.py`` checks that the two agree, so the documentation cannot drift.

Rules every table follows (DESIGN.md invariants 1, 2, 9):
* Offsets only, never pointers: a field that refers to another place holds ``*_offset_bytes``
  from the region base.
* One writer per 64-byte line at a time. On non-coherent memory a flush writes back the whole
  line, so a line written by two nodes loses updates. Structures are padded to whole lines and
  the "writer" column names the single party allowed to write the line (or the hand-off rule).
* Multi-word records are published in order: fields first, flush, then the state word, flush.

Format version history (increment whenever any table below changes meaning or size):
  1  first format: header, node table, root directory.

The layout signature (``layout_signature()``) hashes every struct's field names, offsets, types,
itemsize and alignment together with the cache-line size; attach refuses a region whose
signature differs from this build's, naming both.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

LINE_BYTES = 64
PAGE_BYTES = 4096

MAGIC = int.from_bytes(b"TRACTRG\x01", "little")
"""First word of every region: ASCII 'TRACTRG' plus 0x01."""

FORMAT_VERSION = 1

HEADER_RESERVED_BYTES = PAGE_BYTES
"""The header occupies the first page; the node table starts on the next page."""


@dataclass(frozen=True, kw_only=True)
class Field:
    """One row of a layout table."""
    offset: int
    size: int
    type: str      # numpy type string: "<u8", "<i8", "<u4", "S32", ...
    name: str
    writer: str    # who may write it: "creator", "owner", "manager", "lock holder", ...


@dataclass(frozen=True, kw_only=True)
class Struct:
    """A documented on-region structure: its table and its dtype (which must agree)."""
    name: str
    fields: tuple[Field, ...]
    dtype: np.dtype
    itemsize: int


# -------------------------------------------------------------------------------------------
# Header: the first page. Lines 0-1 are written once by the creator and never again, so every
# attacher may read them without a lock. ``init_state`` is the last word written (publish
# order: all fields, flush, init_state = READY, flush); an attacher refuses a region that is
# not READY.
#
# | off | size | type | field               | writer  |
# |-----|------|------|---------------------|---------|
# |   0 |    8 | u64  | magic               | creator |
# |   8 |    4 | u32  | format_version      | creator |
# |  12 |    4 | u32  | line_bytes          | creator |
# |  16 |    8 | u64  | layout_signature    | creator |
# |  24 |    8 | u64  | region_bytes        | creator |
# |  32 |    8 | u64  | uuid_hi             | creator |
# |  40 |    8 | u64  | uuid_lo             | creator |
# |  48 |    4 | u32  | max_nodes           | creator |
# |  52 |    4 | u32  | root_slots          | creator |
# |  56 |    8 | i64  | created_ns          | creator |
# |  64 |    8 | u64  | node_table_offset   | creator |
# |  72 |    8 | u64  | node_table_bytes    | creator |
# |  80 |    8 | u64  | rootdir_offset      | creator |
# |  88 |    8 | u64  | rootdir_bytes       | creator |
# |  96 |    8 | u64  | data_offset         | creator |
# | 104 |    8 | u64  | data_bytes          | creator |
# | 112 |    8 | u64  | header_checksum     | creator |  crc32 of bytes 0..111
# | 120 |    8 | u64  | init_state          | creator |  0 INITIALIZING, READY: written last
# -------------------------------------------------------------------------------------------
HEADER = Struct(
    name="header",
    fields=(
        Field(offset=0, size=8, type="<u8", name="magic", writer="creator"),
        Field(offset=8, size=4, type="<u4", name="format_version", writer="creator"),
        Field(offset=12, size=4, type="<u4", name="line_bytes", writer="creator"),
        Field(offset=16, size=8, type="<u8", name="layout_signature", writer="creator"),
        Field(offset=24, size=8, type="<u8", name="region_bytes", writer="creator"),
        Field(offset=32, size=8, type="<u8", name="uuid_hi", writer="creator"),
        Field(offset=40, size=8, type="<u8", name="uuid_lo", writer="creator"),
        Field(offset=48, size=4, type="<u4", name="max_nodes", writer="creator"),
        Field(offset=52, size=4, type="<u4", name="root_slots", writer="creator"),
        Field(offset=56, size=8, type="<i8", name="created_ns", writer="creator"),
        Field(offset=64, size=8, type="<u8", name="node_table_offset", writer="creator"),
        Field(offset=72, size=8, type="<u8", name="node_table_bytes", writer="creator"),
        Field(offset=80, size=8, type="<u8", name="rootdir_offset", writer="creator"),
        Field(offset=88, size=8, type="<u8", name="rootdir_bytes", writer="creator"),
        Field(offset=96, size=8, type="<u8", name="data_offset", writer="creator"),
        Field(offset=104, size=8, type="<u8", name="data_bytes", writer="creator"),
        Field(offset=112, size=8, type="<u8", name="header_checksum", writer="creator"),
        Field(offset=120, size=8, type="<u8", name="init_state", writer="creator"),
    ),
    dtype=np.dtype([
        ("magic", "<u8"), ("format_version", "<u4"), ("line_bytes", "<u4"),
        ("layout_signature", "<u8"), ("region_bytes", "<u8"), ("uuid_hi", "<u8"),
        ("uuid_lo", "<u8"), ("max_nodes", "<u4"), ("root_slots", "<u4"), ("created_ns", "<i8"),
        ("node_table_offset", "<u8"), ("node_table_bytes", "<u8"), ("rootdir_offset", "<u8"),
        ("rootdir_bytes", "<u8"), ("data_offset", "<u8"), ("data_bytes", "<u8"),
        ("header_checksum", "<u8"), ("init_state", "<u8"),
    ]),
    itemsize=128,
)
HEADER_CHECKSUM_SPAN = 112
INIT_STATE_OFFSET = 120
INIT_READY = int.from_bytes(b"READY\x00\x00\x01", "little")

# -------------------------------------------------------------------------------------------
# Node table: one line per node id, ``max_nodes`` lines, written only by the node that owns
# the id (single writer). A joiner becomes the owner of a slot whose previous owner left or is
# dead (heartbeat older than the liveness timeout): ownership passes by death, never by sharing.
#
# | off | size | type | field          | writer |
# |-----|------|------|----------------|--------|
# |   0 |    8 | u64  | state          | owner  |  0 FREE, 1 LIVE, 2 LEFT
# |   8 |    8 | u64  | epoch          | owner  |  +1 on every join of this id
# |  16 |    8 | u64  | owner_nonce    | owner  |  random per join; a changed nonce = evicted
# |  24 |    8 | u64  | pid            | owner  |
# |  32 |    8 | i64  | heartbeat_ns   | owner  |  CLOCK_REALTIME of the last beat
# |  40 |    8 | u64  | heartbeat_seq  | owner  |  +1 per beat
# |  48 |    8 | u64  | host_id        | owner  |  hash of hostname and boot id
# |  56 |    8 | i64  | joined_ns      | owner  |
# -------------------------------------------------------------------------------------------
NODE = Struct(
    name="node",
    fields=(
        Field(offset=0, size=8, type="<u8", name="state", writer="owner"),
        Field(offset=8, size=8, type="<u8", name="epoch", writer="owner"),
        Field(offset=16, size=8, type="<u8", name="owner_nonce", writer="owner"),
        Field(offset=24, size=8, type="<u8", name="pid", writer="owner"),
        Field(offset=32, size=8, type="<i8", name="heartbeat_ns", writer="owner"),
        Field(offset=40, size=8, type="<u8", name="heartbeat_seq", writer="owner"),
        Field(offset=48, size=8, type="<u8", name="host_id", writer="owner"),
        Field(offset=56, size=8, type="<i8", name="joined_ns", writer="owner"),
    ),
    dtype=np.dtype([
        ("state", "<u8"), ("epoch", "<u8"), ("owner_nonce", "<u8"), ("pid", "<u8"),
        ("heartbeat_ns", "<i8"), ("heartbeat_seq", "<u8"), ("host_id", "<u8"),
        ("joined_ns", "<i8"),
    ]),
    itemsize=64,
)
NODE_FREE, NODE_LIVE, NODE_LEFT = 0, 1, 2

# -------------------------------------------------------------------------------------------
# Root directory: ``root_slots`` lines, name -> (offset, size, kind) of a root object (the
# paper's shared object store). Written by the creator while the region is INITIALIZING, and
# afterwards only by a node holding the global lock. Publish order: name, offset, nbytes, kind,
# flush, then state = READY, flush. Readers take no lock: they check state == READY.
#
# | off | size | type | field        | writer                      |
# |-----|------|------|--------------|-----------------------------|
# |   0 |   32 | S32  | name         | creator / global-lock holder |  UTF-8, NUL padded
# |  32 |    8 | u64  | offset_bytes | creator / global-lock holder |
# |  40 |    8 | u64  | nbytes       | creator / global-lock holder |
# |  48 |    8 | u64  | kind         | creator / global-lock holder |  free-form type tag
# |  56 |    8 | u64  | state        | creator / global-lock holder |  0 EMPTY, 1 READY
# -------------------------------------------------------------------------------------------
ROOT_ENTRY = Struct(
    name="root_entry",
    fields=(
        Field(offset=0, size=32, type="|S32", name="name", writer="creator / global-lock holder"),
        Field(offset=32, size=8, type="<u8", name="offset_bytes",
              writer="creator / global-lock holder"),
        Field(offset=40, size=8, type="<u8", name="nbytes", writer="creator / global-lock holder"),
        Field(offset=48, size=8, type="<u8", name="kind", writer="creator / global-lock holder"),
        Field(offset=56, size=8, type="<u8", name="state", writer="creator / global-lock holder"),
    ),
    dtype=np.dtype([("name", "S32"), ("offset_bytes", "<u8"), ("nbytes", "<u8"),
                    ("kind", "<u8"), ("state", "<u8")]),
    itemsize=64,
)
ROOT_NAME_BYTES = 32
ROOT_EMPTY, ROOT_READY = 0, 1

STRUCTS: list[Struct] = [HEADER, NODE, ROOT_ENTRY]
"""Every on-region structure. All of them are defined in this module (never registered from
another one), so the signature cannot depend on which modules a process happened to import."""


def layout_signature() -> int:
    """64-bit hash of every struct's fields, sizes and alignment plus the line size."""
    h = hashlib.sha256()
    h.update(f"line={LINE_BYTES};page={PAGE_BYTES};".encode())
    for s in sorted(STRUCTS, key=lambda s: s.name):
        h.update(f"{s.name}:{s.dtype.itemsize}:{s.dtype.alignment}:".encode())
        for name in s.dtype.names or ():
            dt, off = s.dtype.fields[name][:2]
            h.update(f"{name}@{off}={dt.str};".encode())
    return int.from_bytes(h.digest()[:8], "little")


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)
