"""Byte layout of every on-region structure: tables, numpy dtypes, and the layout signature.

Every structure stored in the region is described twice, on purpose: a human table (offset,
size, type, field, writer) that documents who may write each word, and a numpy dtype the code
uses. ``tests/region/test_layout.py`` checks that the two agree, so the documentation cannot drift.

Rules every table follows (docs/design.md invariants 1, 2, 9):
* Offsets only, never pointers: a field that refers to another place holds ``*_offset_bytes``
  from the region base.
* One writer per 64-byte line at a time. On non-coherent memory a flush writes back the whole
  line, so a line written by two nodes loses updates. Structures are padded to whole lines and
  the "writer" column names the single party allowed to write the line (or the hand-off rule).
* Multi-word records are published in order: fields first, flush, then the state word, flush.

Format version history (increment whenever any table below changes meaning or size):
  1  first format: header, node table, root directory.
  2  global lock (lock state, request and grant lines), lock-manager election lines, and the
     two-tier allocator (journal, per-node chunk counts, chunk owners, heap records, return
     rings); see the tables marked "sync" and "alloc" below.
  3  prefix index (index header and two-line entries); see the tables marked "index".
  4  slot tags ("alloc.tags", SLOT_TAG): every payload slot records which index reservation
     (entry slot, version) it holds, so a read can prove the slot still holds its block.
  5  the lock grant line's check word.
  6  doorbell lines ("sync.doorbells", DOORBELL).
  7  index lanes (INDEX_LANE; entry s belongs to lane s % lanes).
  8  namespace records ("namespaces", NAMESPACE): each namespace's KV layout, and the index
     entry's ``flags`` bits 32..47 name the record its producer stored it under.

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

FORMAT_VERSION = 8

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

# ===========================================================================================
# sync: the global lock (tract_async/sync). Section "sync.locks" holds, for each lock index l,
# one LOCK_STATE line, then ``max_nodes`` LOCK_REQ lines, then ``max_nodes`` LOCK_GRANT lines.
# Section "sync.manager" holds one MANAGER line, then ``max_nodes`` MANAGER_CANDIDATE lines.
# Request lines are written only by their node, grant and state lines only by the manager of
# the current term: no line has two writers (docs/design.md invariant 2). The protocol is the essay
# of ``sync/slots.py``.
# ===========================================================================================

def _u8_fields(names: tuple[str, ...], writer: str, itemsize: int = 64) -> tuple[Field, ...]:
    fields = [Field(offset=8 * i, size=8, type="<u8", name=n, writer=writer)
              for i, n in enumerate(names)]
    used = 8 * len(names)
    if used < itemsize:
        fields.append(Field(offset=used, size=itemsize - used, type=f"|V{itemsize - used}",
                            name="pad", writer="nobody"))
    return tuple(fields)


def _u8_dtype(names: tuple[str, ...], itemsize: int = 64) -> np.dtype:
    spec = [(n, "<u8") for n in names]
    if 8 * len(names) < itemsize:
        spec.append(("pad", f"|V{itemsize - 8 * len(names)}"))
    return np.dtype(spec)


# Lock state: one line per lock index; writer: the manager of the current term.
#
# | off | size | type | field              | writer  |
# |-----|------|------|--------------------|---------|
# |   0 |    8 | u64  | holder             | manager |  node id + 1 of the holder, 0 when free
# |   8 |    8 | u64  | holder_req         | manager |  the holder's req_seq that was granted
# |  16 |    8 | u64  | token              | manager |  fencing token of the current/last grant
# |  24 |    8 | u64  | term               | manager |  manager term that wrote this line
# |  32 |    8 | u64  | grants             | manager |  grants issued (all terms)
# |  40 |    8 | u64  | revocations        | manager |  holders revoked for a stale heartbeat
# |  48 |    8 | u64  | last_revoked_token | manager |  a write stamped with it is refused
# |  56 |    8 | u64  | rr_cursor          | manager |  node id the round-robin scan resumes after
_LOCK_STATE_NAMES = ("holder", "holder_req", "token", "term", "grants", "revocations",
                     "last_revoked_token", "rr_cursor")
LOCK_STATE = Struct(name="lock_state", fields=_u8_fields(_LOCK_STATE_NAMES, "manager"),
                    dtype=_u8_dtype(_LOCK_STATE_NAMES), itemsize=64)

# Lock request: one line per (lock, node); writer: the node (whichever of its processes holds
# the node-local tier; the hand-off between them is the OFD lock, see sync/local.py).
#
# | off | size | type | field        | writer |
# |-----|------|------|--------------|--------|
# |   0 |    8 | u64  | req_seq      | node   |  +1 per request: W while req_seq > rel_seq
# |   8 |    8 | u64  | rel_seq      | node   |  = req_seq on release or withdrawal: I
# |  16 |    8 | u64  | epoch        | node   |  node epoch of the requester
# |  24 |    8 | u64  | requested_ns | node   |  CLOCK_REALTIME of the request (diagnostics)
# |  32 |   32 | V32  | pad          | nobody |
_LOCK_REQ_NAMES = ("req_seq", "rel_seq", "epoch", "requested_ns")
LOCK_REQ = Struct(name="lock_req", fields=_u8_fields(_LOCK_REQ_NAMES, "node"),
                  dtype=_u8_dtype(_LOCK_REQ_NAMES), itemsize=64)

# Lock grant: one line per (lock, node); writer: the manager of the current term. L for the
# node while grant_seq == its req_seq > its rel_seq.
#
# | off | size | type | field      | writer  |
# |-----|------|------|------------|---------|
# |   0 |    8 | u64  | grant_seq  | manager |  the req_seq granted last
# |   8 |    8 | u64  | token      | manager |  fencing token of that grant
# |  16 |    8 | u64  | term       | manager |  manager term that granted it
# |  24 |    8 | u64  | granted_ns | manager |  CLOCK_REALTIME of the grant
# |  32 |    8 | u64  | check      | manager |  grant_check(grant_seq, token): a read that mixes
# |     |      |      |            |         |  two grants' words (a line written back or filled
# |     |      |      |            |         |  word by word) fails it and is polled again
# |  40 |   24 | V24  | pad        | nobody  |
_LOCK_GRANT_NAMES = ("grant_seq", "token", "term", "granted_ns", "check")
LOCK_GRANT = Struct(name="lock_grant", fields=_u8_fields(_LOCK_GRANT_NAMES, "manager"),
                    dtype=_u8_dtype(_LOCK_GRANT_NAMES), itemsize=64)

# Manager line: who manages, in which term. Writer: the winner of an election, inside the
# election's bakery critical section (and the manager itself when it resigns). Hand-off is by
# election only: a new term is written only after the old manager's node was judged dead or it
# resigned (sync/manager.py).
#
# | off | size | type | field     | writer            |
# |-----|------|------|-----------|-------------------|
# |   0 |    8 | u64  | manager   | election winner   |  node id + 1, 0 when none
# |   8 |    8 | u64  | term      | election winner   |  +1 per takeover; tokens are term<<32|n
# |  16 |    8 | u64  | epoch     | election winner   |  node epoch of the manager
# |  24 |    8 | u64  | since_ns  | election winner   |  CLOCK_REALTIME of the takeover
# |  32 |   32 | V32  | pad       | nobody            |
_MANAGER_NAMES = ("manager", "term", "epoch", "since_ns")
MANAGER = Struct(name="manager", fields=_u8_fields(_MANAGER_NAMES, "election winner"),
                 dtype=_u8_dtype(_MANAGER_NAMES), itemsize=64)

# Manager candidate: one line per node, the bakery (Lamport) entry of that node's election
# attempts. Writer: the node.
#
# | off | size | type | field     | writer |
# |-----|------|------|-----------|--------|
# |   0 |    8 | u64  | choosing  | node   |  1 while picking a number
# |   8 |    8 | u64  | number    | node   |  bakery ticket, 0 when not competing
# |  16 |    8 | u64  | candidate | node   |  1 while a LockManager runs on the node
# |  24 |    8 | u64  | epoch     | node   |  node epoch that wrote the line
# |  32 |    8 | u64  | scan_ns   | node   |  CLOCK_REALTIME of the node's last manager slice
# |     |      |      |           |        |  while it manages: a manager whose stamp is older
# |     |      |      |           |        |  than the liveness timeout has stopped granting
# |  40 |   24 | V24  | pad       | nobody |
_CANDIDATE_NAMES = ("choosing", "number", "candidate", "epoch", "scan_ns")
MANAGER_CANDIDATE = Struct(name="manager_candidate", fields=_u8_fields(_CANDIDATE_NAMES, "node"),
                           dtype=_u8_dtype(_CANDIDATE_NAMES), itemsize=64)

# ===========================================================================================
# alloc: the two-tier allocator (region/alloc.py, region/chunks.py). Sections:
#   "alloc.meta"   one ALLOC_JOURNAL line, then ``max_nodes`` ALLOC_COUNT records (2 to a
#                  line: all written under the global lock, so packing is safe)
#   "alloc.bitmap" one bit per chunk (u64 words), written under the global lock
#   "alloc.owners" one CHUNK_OWNER record per chunk (2 to a line), written under the global lock
#   "alloc.heaps"  per chunk, one HEAP_META line and ``bitmap_lines`` HEAP_BITS lines, written
#                  only by the chunk's owner node
#   "alloc.rings"  per (owner, sender) pair a RING_HEAD line (sender), a RING_TAIL line (owner)
#                  and ``ring_entries`` u64 entries (sender)
#   "alloc.tags"   per chunk, ``chunk_bytes // min_slot_bytes`` SLOT_TAG words padded to whole
#                  lines (so no line spans two chunks, whose owners differ), written only by the
#                  chunk's owner node
#   "alloc.chunks" the chunks themselves; ``kind`` of the section is chunk_bytes
# ===========================================================================================

# Journal of the global chunk tier: the lock holder's intent, so that a holder that dies (or is
# revoked) midway leaves a change that the next holder rolls back. Writer: the lock holder.
#
# | off | size | type | field       | writer      |
# |-----|------|------|-------------|-------------|
# |   0 |    8 | u64  | state       | lock holder |  0 IDLE, 1 PENDING (written last / first)
# |   8 |    8 | u64  | op          | lock holder |  1 CLAIM, 2 RELEASE, 3 RECLAIM
# |  16 |    8 | u64  | node        | lock holder |  node id + 1 the op is for
# |  24 |    8 | u64  | node_epoch  | lock holder |
# |  32 |    8 | u64  | token       | lock holder |  fencing token of the holder
# |  40 |    8 | u64  | first_chunk | lock holder |
# |  48 |    8 | u64  | count       | lock holder |
# |  56 |    8 | u64  | seq         | lock holder |  +1 per journaled op
_JOURNAL_NAMES = ("state", "op", "node", "node_epoch", "token", "first_chunk", "count", "seq")
ALLOC_JOURNAL = Struct(name="alloc_journal", fields=_u8_fields(_JOURNAL_NAMES, "lock holder"),
                       dtype=_u8_dtype(_JOURNAL_NAMES), itemsize=64)

# Per-node allocator record (2 to a line). Writer: the lock holder.
#
# | off | size | type | field           | writer      |
# |-----|------|------|-----------------|-------------|
# |   0 |    8 | u64  | chunks          | lock holder |  chunks the node owns (recount on recovery)
# |   8 |    8 | u64  | reclaimed_epoch | lock holder |  node epoch whose chunks were reclaimed:
#                                                         that incarnation may not allocate again
# |  16 |    8 | u64  | wanted          | lock holder |  chunks the node asked for and found none
#                                                         free (0: none); owners holding spare
#                                                         ones release some (alloc.py, "Starving")
# |  24 |    8 | u64  | wanted_ns       | lock holder |  CLOCK_REALTIME of that ask (stale asks of
#                                                         a node that stopped asking expire)
ALLOC_COUNT = Struct(name="alloc_count", fields=(
    Field(offset=0, size=8, type="<u8", name="chunks", writer="lock holder"),
    Field(offset=8, size=8, type="<u8", name="reclaimed_epoch", writer="lock holder"),
    Field(offset=16, size=8, type="<u8", name="wanted", writer="lock holder"),
    Field(offset=24, size=8, type="<u8", name="wanted_ns", writer="lock holder")),
    dtype=np.dtype([("chunks", "<u8"), ("reclaimed_epoch", "<u8"), ("wanted", "<u8"),
                    ("wanted_ns", "<u8")]), itemsize=32)

# Chunk owner record (2 to a line). Writer: the lock holder. The bitmap bit of the chunk is set
# exactly when ``owner`` is non-zero (fsck checks it).
#
# | off | size | type | field       | writer      |
# |-----|------|------|-------------|-------------|
# |   0 |    8 | u64  | owner       | lock holder |  node id + 1, 0 when free
# |   8 |    8 | u64  | owner_epoch | lock holder |  epoch of the owner when claimed
# |  16 |    8 | u64  | generation  | lock holder |  +1 on every claim and every release
# |  24 |    8 | u64  | claim_token | lock holder |  fencing token of the claim
_OWNER_NAMES = ("owner", "owner_epoch", "generation", "claim_token")
CHUNK_OWNER = Struct(name="chunk_owner", fields=_u8_fields(_OWNER_NAMES, "lock holder", 32),
                     dtype=_u8_dtype(_OWNER_NAMES, 32), itemsize=32)

# Heap record of one chunk: how its owner carved it. Writer: the chunk's owner node (the claim
# writes it before the chunk is used; recovery of a dead owner only clears the owner record).
#
# | off | size | type | field      | writer |
# |-----|------|------|------------|--------|
# |   0 |    8 | u64  | slot_bytes | owner  |  0 = not carved yet
# |   8 |    8 | u64  | nslots     | owner  |
# |  16 |    8 | u64  | generation | owner  |  the chunk generation it was carved under
# |  24 |    8 | u64  | used       | owner  |  slots in use (popcount of the bitmap)
# |  32 |   32 | V32  | pad        | nobody |
_HEAP_NAMES = ("slot_bytes", "nslots", "generation", "used")
HEAP_META = Struct(name="heap_meta", fields=_u8_fields(_HEAP_NAMES, "owner"),
                   dtype=_u8_dtype(_HEAP_NAMES), itemsize=64)

# Heap bitmap line: 512 slot bits (bit i of word w = slot 64*w + i is in use). Writer: owner.
HEAP_BITS = Struct(name="heap_bits", fields=tuple(
    Field(offset=8 * i, size=8, type="<u8", name=f"w{i}", writer="owner") for i in range(8)),
    dtype=np.dtype([(f"w{i}", "<u8") for i in range(8)]), itemsize=64)

# Return ring of one (owner, sender) pair: slots of ``owner`` freed by ``sender`` travel home
# through it. Head line and entries are written by the sender, the tail line by the owner.
# Entry = (generation & 0xFFFFFF) << 40 | chunk << 16 | slot, never 0 (generation >= 1).
#
# | off | size | type | field | writer |
# |-----|------|------|-------|--------|
# |   0 |    8 | u64  | head  | sender |  entries pushed (entry k at index k % ring_entries)
# |   8 |   56 | V56  | pad   | nobody |
RING_HEAD = Struct(name="ring_head", fields=_u8_fields(("head",), "sender"),
                   dtype=_u8_dtype(("head",)), itemsize=64)
# | off | size | type | field | writer |
# |-----|------|------|-------|--------|
# |   0 |    8 | u64  | tail  | owner  |  entries consumed
# |   8 |   56 | V56  | pad   | nobody |
RING_TAIL = Struct(name="ring_tail", fields=_u8_fields(("tail",), "owner"),
                   dtype=_u8_dtype(("tail",)), itemsize=64)

# Slot tag: one word per ``min_slot_bytes`` of a chunk; the word of a slot is the one at the
# slot's first byte (every slot is at least ``min_slot_bytes`` long, so no two slots share a
# word). Writer: the chunk's owner node -- zeroed when it carves the chunk, then stored by the
# reservation that hands the slot to an index entry, before any payload byte is written.
# A reader checks it after its copy (``index.revalidate_batch``): a slot handed to another
# reservation since, or carved again, shows another tag, so a stale index entry reads as a
# miss, never as another block's bytes.
#
# | off | size | type | field | writer |
# |-----|------|------|-------|--------|
# |   0 |    8 | u64  | tag   | owner  |  (entry slot + 1) << 40 | (entry version & 2**40-1); 0 none
SLOT_TAG = Struct(name="slot_tag", fields=(
    Field(offset=0, size=8, type="<u8", name="tag", writer="owner"),),
    dtype=np.dtype([("tag", "<u8")]), itemsize=8)

STRUCTS: list[Struct] = [HEADER, NODE, ROOT_ENTRY, LOCK_STATE, LOCK_REQ, LOCK_GRANT, MANAGER,
                         MANAGER_CANDIDATE, ALLOC_JOURNAL, ALLOC_COUNT, CHUNK_OWNER, HEAP_META,
                         HEAP_BITS, RING_HEAD, RING_TAIL, SLOT_TAG]
"""Every on-region structure. All of them are defined in this module (never registered from
another one), so the signature cannot depend on which modules a process happened to import."""


# ===========================================================================================
# Section "sync.doorbells" (tract_async/stores/doorbell.py): ``max_nodes`` DOORBELL lines, one per
# node, each written only by its node's event-loop thread (docs/design.md invariant 2). A producer
# reads every line after it publishes (invalidate, fence, load) and rings the doorbell of each
# node that says it waits.
# | off | size | type | field    | writer |
# |-----|------|------|----------|--------|
# |   0 |    8 | u64  | waiting  | node   |  waits now pending on the node (0: none)
# |   8 |    8 | u64  | epoch    | node   |  node epoch that wrote the line
# |  16 |   48 | V48  | pad      | nobody |
_DOORBELL_NAMES = ("waiting", "epoch")
DOORBELL = Struct(name="doorbell", fields=_u8_fields(_DOORBELL_NAMES, "node"),
                  dtype=_u8_dtype(_DOORBELL_NAMES), itemsize=64)
STRUCTS += [DOORBELL]


# ===========================================================================================
# index: the prefix index (tract_async/region/index.py). Section "index" = one header page,
# then ``capacity`` entries of two lines each (open addressing, probing in groups of ``lanes``
# entries: entry s belongs to lane s % lanes, and lane n is written lock-free by node n alone).
#
# INDEX_HEADER (first line written once by the creator; second line by the global-lock holder)
# | off | size | type | field        | writer      |
# |-----|------|------|--------------|-------------|
# |   0 |    8 | u64  | magic        | creator     |  ASCII "TRACTIX" + 2
# |   8 |    8 | u64  | capacity     | creator     |  entries, a power of two
# |  16 |    8 | u64  | max_probe    | creator     |  probe window, in groups of ``lanes``
# |  24 |    8 | u64  | entries_off  | creator     |  bytes from the region base
# |  32 |    8 | u64  | lanes        | creator     |  a power of two, 1..INDEX_MAX_LANES
# |  40 |   24 | V24  | pad0         | nobody      |
# |  64 |    8 | u64  | clock_hand   | lock holder |  eviction sampling cursor
# |  72 |   56 | V56  | pad1         | nobody      |
#
# INDEX_LANE: ``lanes`` lines from byte 128 of the header page, line n written by node n only
# (its counters: one writer per line without the lock, docs/design.md invariant 2).
# | off | size | type | field      | writer     |
# |-----|------|------|------------|------------|
# |   0 |    8 | u64  | publishes  | lane owner |  entries this node reserved
# |   8 |    8 | u64  | evictions  | lane owner |  entries this node evicted (anyone's)
# |  16 |    8 | u64  | active     | lane owner |  1 once its owner may have written the lane:
# |     |      |      |            |            |  readers skip lanes still 0 (set before any entry)
# |  24 |   40 | V40  | pad        | nobody     |
#
# INDEX_ENTRY: line 0 says *what* and *where*, line 1 *how far* and *how recently*.
# Hand-off rule (docs/design.md invariant 2; index.py, "Who writes what"): an EMPTY or TOMBSTONE
# entry of lane n is written only by node n, which RESERVES it without the global lock and alone
# writes layer bits and, last, state = READY; a READY entry is written only by the global-lock
# holder, whose last write to it is the TOMBSTONE (version first, state last, one flush), after
# which it is lane n's again. Recovery (a lock holder) may take back the entries of a dead node's
# lane. ``version`` changes on every reserve and every eviction, never otherwise. "owner" below:
# the lane owner while EMPTY/TOMBSTONE/RESERVED, the lock holder while READY.
# | off | size | type | field          | writer               |
# |-----|------|------|----------------|----------------------|
# |   0 |    8 | u64  | key0           | owner                |  the block key, 256 bits
# |   8 |    8 | u64  | key1           | owner                |
# |  16 |    8 | u64  | key2           | owner                |
# |  24 |    8 | u64  | key3           | owner                |
# |  32 |    8 | u64  | version        | owner / lock holder  |  +1 on reserve and evict
# |  40 |    8 | u64  | state          | owner / lock holder  |  EMPTY RESERVED READY TOMBSTONE
# |  48 |    8 | u64  | payload_offset | owner                |  bytes from the region base
# |  56 |    8 | u64  | payload_nbytes | owner                |
# |  64 |    8 | u64  | layers_lo      | owner                |  bit l: layer l is in memory
# |  72 |    8 | u64  | layers_hi      | owner                |  layers 64..127
# |  80 |    8 | u64  | owner          | owner                |  allocation: owner node | gen<<16
# |  88 |    8 | u64  | alloc_token    | owner                |  allocation fencing token
# |  96 |    8 | u64  | last_access_ns | owner / lock holder  |  approximate LRU clock
# | 104 |    8 | u64  | producer       | owner                |  node id of the producer
# | 112 |    8 | u64  | flags          | owner                |  bit 0: transfer-only; bits 32..47:
# |     |      |      |                |                      |  namespace tag (NAMESPACE slot + 1)
# | 120 |    8 | u64  | deadline_ns    | owner                |  transfer-only expiry
# ===========================================================================================
_INDEX_HEADER_DTYPE = np.dtype([("magic", "<u8"), ("capacity", "<u8"), ("max_probe", "<u8"),
                                ("entries_off", "<u8"), ("lanes", "<u8"), ("pad0", "V24"),
                                ("clock_hand", "<u8"), ("pad1", "V56")])
INDEX_HEADER = Struct(
    name="index_header",
    fields=(
        Field(offset=0, size=8, type="<u8", name="magic", writer="creator"),
        Field(offset=8, size=8, type="<u8", name="capacity", writer="creator"),
        Field(offset=16, size=8, type="<u8", name="max_probe", writer="creator"),
        Field(offset=24, size=8, type="<u8", name="entries_off", writer="creator"),
        Field(offset=32, size=8, type="<u8", name="lanes", writer="creator"),
        Field(offset=40, size=24, type="V24", name="pad0", writer="nobody"),
        Field(offset=64, size=8, type="<u8", name="clock_hand", writer="lock holder"),
        Field(offset=72, size=56, type="V56", name="pad1", writer="nobody"),
    ),
    dtype=_INDEX_HEADER_DTYPE, itemsize=128)
_INDEX_LANE_NAMES = ("publishes", "evictions", "active")
INDEX_LANE = Struct(name="index_lane", fields=_u8_fields(_INDEX_LANE_NAMES, "lane owner"),
                    dtype=_u8_dtype(_INDEX_LANE_NAMES), itemsize=64)
INDEX_LANES_OFFSET = 128
"""Byte of the header page where lane 0's INDEX_LANE line starts."""
INDEX_MAX_LANES = 32
"""At most this many lanes (their lines fit the header page); a region for more nodes has one
lane, and every reservation takes the global lock."""
_INDEX_ENTRY_NAMES = ("key0", "key1", "key2", "key3", "version", "state", "payload_offset",
                      "payload_nbytes", "layers_lo", "layers_hi", "owner", "alloc_token",
                      "last_access_ns", "producer", "flags", "deadline_ns")
_INDEX_ENTRY_WRITERS = {"version": "owner / lock holder", "state": "owner / lock holder",
                        "last_access_ns": "owner / lock holder"}
INDEX_ENTRY = Struct(
    name="index_entry",
    fields=tuple(Field(offset=8 * i, size=8, type="<u8", name=n,
                       writer=_INDEX_ENTRY_WRITERS.get(n, "owner"))
                 for i, n in enumerate(_INDEX_ENTRY_NAMES)),
    dtype=np.dtype([(n, "<u8") for n in _INDEX_ENTRY_NAMES]), itemsize=128)
IX_EMPTY, IX_RESERVED, IX_READY, IX_TOMBSTONE = 0, 1, 2, 3
INDEX_MAGIC = int.from_bytes(b"TRACTIX\x02", "little")

STRUCTS += [INDEX_HEADER, INDEX_LANE, INDEX_ENTRY]
INDEX_FLAG_NS_SHIFT = 32
"""Bits 32..47 of an index entry's ``flags``: the namespace tag (record slot + 1, 0: none) its
producer stored it under (``region/namespaces.py``)."""
INDEX_FLAG_NS_MASK = 0xFFFF


# ===========================================================================================
# Section "namespaces" (tract_async/region/namespaces.py): ``NAMESPACE_SLOTS`` records of two
# lines, the KV layout of every namespace that ever stored a block here. A record is written
# once, by a global-lock holder, when its namespace first opens an engine on the region, and
# never again (entries may name it long after its engines left). Publish order: every field of
# both lines (cached stores), flush both lines, fence, then ``state = READY`` (store, flush).
# Readers take no lock: invalidate both lines, read, use the record only when READY.
# Line 0 says *who*, line 1 *what layout*.
# | off | size | type | field        | writer      |
# |-----|------|------|--------------|-------------|
# |   0 |    8 | u64  | ns_id        | lock holder |  hash of (namespace, rank, world_size), never 0
# |   8 |    4 | u32  | rank         | lock holder |
# |  12 |    4 | u32  | world_size   | lock holder |
# |  16 |   32 | S32  | name         | lock holder |  the namespace, UTF-8, cut to 32 bytes (messages)
# |  48 |    8 | u64  | recorded_by  | lock holder |  node id that wrote the record
# |  56 |    8 | u64  | state        | lock holder |  0 EMPTY, 1 READY: stored last
# |  64 |    4 | u32  | num_layers   | lock holder |
# |  68 |    4 | u32  | block_tokens | lock holder |
# |  72 |    4 | u32  | kv_heads     | lock holder |
# |  76 |    4 | u32  | head_dim     | lock holder |
# |  80 |    8 | u64  | block_bytes  | lock holder |
# |  88 |   16 | S16  | dtype        | lock holder |  the dtype's name ("bfloat16"), NUL padded
# | 104 |    8 | i64  | recorded_ns  | lock holder |  CLOCK_REALTIME of the record
# | 112 |   16 | V16  | pad          | nobody      |
# ===========================================================================================
_NS_FIELDS = (("ns_id", "<u8"), ("rank", "<u4"), ("world_size", "<u4"), ("name", "|S32"),
              ("recorded_by", "<u8"), ("state", "<u8"), ("num_layers", "<u4"),
              ("block_tokens", "<u4"), ("kv_heads", "<u4"), ("head_dim", "<u4"),
              ("block_bytes", "<u8"), ("dtype", "|S16"), ("recorded_ns", "<i8"), ("pad", "|V16"))


def _packed_fields(spec: tuple[tuple[str, str], ...], writer: str) -> tuple[Field, ...]:
    out, off = [], 0
    for name, t in spec:
        size = np.dtype(t).itemsize
        out.append(Field(offset=off, size=size, type=t, name=name,
                         writer="nobody" if name == "pad" else writer))
        off += size
    return tuple(out)


NAMESPACE = Struct(name="namespace", fields=_packed_fields(_NS_FIELDS, "lock holder"),
                   dtype=np.dtype(list(_NS_FIELDS)), itemsize=128)
NAMESPACE_SLOTS = 255
"""Records in a region: tags 1..255 fit the entry's tag bits with room to spare, and 255
(model, rank) pairs -- 31 models of 8 ranks each -- is more than one region is shared by; the
section is 32 KiB."""
NAMESPACE_NAME_BYTES = 32
NAMESPACE_DTYPE_BYTES = 16
NS_EMPTY, NS_READY = 0, 1
STRUCTS += [NAMESPACE]


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
