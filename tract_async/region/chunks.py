"""The global tier of the allocator: the chunk bitmap, chunk owners, the journal, recovery.

Who writes what (tables in ``layout.py``): everything in this module is written only by the
holder of the global lock (lock index 0), so although several records share a line, the line has
one writer at a time, handed over by the lock: a new holder invalidates before it reads and the
old one flushed before it released (the lock's release order, ``sync/slots.py``). The global tier
never touches the chunks themselves or the per-node heap records (``alloc.py``).

Invariants (checked by ``tract_async/tools/fsck.py``):
* bit ``c`` of the bitmap is set exactly when ``owners[c].owner != 0``;
* ``counts[n].chunks`` is the number of chunks whose owner is ``n``;
* every owned chunk's owner is a live node with the recorded epoch (otherwise recovery reclaims);
* the journal is IDLE whenever no holder is inside a batch.

Journal. Each change is a *batch* under one fencing token: write the intent (op, node, epoch,
token, chunk range) into the journal line, flush, set ``state = PENDING``, flush; do the stores,
each line flushed; set ``state = IDLE``, flush.

Fenced steps. The holder calls ``lock.check_token()`` before every step of a batch (the
journal line, the owner records, the bitmap, the counts, IDLE; each chunk of a release,
reclaim or recovery), not only before the batch. A holder paused after a check is judged
dead, revoked and reclaimed while it cannot run, and the next holder may claim the very chunks
it had chosen (issue 36, model finding A1). Checked once per batch, the resumed holder wrote
its whole batch over the new owner's records and later released a chunk that held the other
node's blocks (the paused-fencing test: fsck "node 1 records 8 chunks, owns 7", index entries
into a free chunk). Checked per step, it stops at its next step with LockRevoked and leaves a
PENDING journal that the next holder undoes (a claim) or completes (a release or reclaim).
What stays is the window between one check and the store right after it, a few instructions
(the residual window of ``sync/slots.py``).

A holder that dies or is revoked inside a batch leaves the journal PENDING, and whoever
holds the lock next runs ``recover_journal``: a CLAIM is rolled back (its chunks were never
handed out: the claimer only uses a chunk after IDLE and a second token check), a RELEASE or
RECLAIM is rolled forward (the chunk was being given up anyway). Both are idempotent and end with
a recount, so a crash of the recoverer is recovered the same way.

Dead nodes. ``reclaim_dead`` releases every chunk whose owner is not live with the recorded
epoch, after calling the ``on_reclaim`` hooks (the prefix index drops entries into those chunks)
and records the reclaimed epoch in the node's count record, so that a paused, not-dead process
of that incarnation finds itself fenced out on its next allocation (``alloc.py``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

import numpy as np
from numba import njit

import tract_kernels as K

from .. import crashpoints as CP
from ..errors import LockRevoked, RegionCorrupt
from . import layout as L
from .region import SectionSpec

if TYPE_CHECKING:
    from .nodes import NodeInfo
    from .region import Region

S_JOURNAL_FLUSH = K.site("alloc.journal.flush")
S_JOURNAL_READ = K.site("alloc.journal.invalidate")
S_OWNER_FLUSH = K.site("alloc.owner.flush")
S_OWNER_READ = K.site("alloc.owner.invalidate")
S_BITMAP_FLUSH = K.site("alloc.bitmap.flush")
S_BITMAP_READ = K.site("alloc.bitmap.invalidate")
S_COUNT_FLUSH = K.site("alloc.count.flush")
S_COUNT_READ = K.site("alloc.count.invalidate")

J_IDLE, J_PENDING = 0, 1
OP_CLAIM, OP_RELEASE, OP_RECLAIM = 1, 2, 3
OP_NAMES = {OP_CLAIM: "claim", OP_RELEASE: "release", OP_RECLAIM: "reclaim"}

SEC_META, SEC_BITMAP, SEC_OWNERS = "alloc.meta", "alloc.bitmap", "alloc.owners"
SEC_HEAPS, SEC_RINGS, SEC_CHUNKS = "alloc.heaps", "alloc.rings", "alloc.chunks"
SEC_TAGS = "alloc.tags"

DEFAULT_CHUNK_BYTES = 2 << 20
DEFAULT_MIN_SLOT_BYTES = 4096
DEFAULT_NUM_LOCKS = 2
DEFAULT_RING_ENTRIES = 128
WANT_TTL_S = 10.0
"""An ask for chunks (``wanted``) older than this no longer counts: its node stopped asking."""

_J = {n: L.ALLOC_JOURNAL.dtype.fields[n][1] for n in L.ALLOC_JOURNAL.dtype.names if n != "pad"}
_O = {n: L.CHUNK_OWNER.dtype.fields[n][1] for n in L.CHUNK_OWNER.dtype.names if n != "pad"}


class AllocGeometry(NamedTuple):
    """Where the allocator's structures are and their parameters (bytes from the region base)."""
    meta_offset: int
    bitmap_offset: int
    owners_offset: int
    heaps_offset: int
    rings_offset: int
    chunks_offset: int
    nchunks: int
    chunk_bytes: int
    min_slot_bytes: int
    heap_bitmap_lines: int
    ring_entries: int
    max_nodes: int
    tags_offset: int
    tag_lines: int
    """Lines of slot tags per chunk (``layout.SLOT_TAG``): one word per ``min_slot_bytes``."""

    def count_off(self, node_id: int) -> int:
        return self.meta_offset + L.LINE_BYTES + node_id * L.ALLOC_COUNT.itemsize

    def owner_off(self, chunk: int) -> int:
        return self.owners_offset + chunk * L.CHUNK_OWNER.itemsize

    def heap_off(self, chunk: int) -> int:
        return self.heaps_offset + chunk * (1 + self.heap_bitmap_lines) * L.LINE_BYTES

    def chunk_off(self, chunk: int) -> int:
        return self.chunks_offset + chunk * self.chunk_bytes

    def tags_off(self, chunk: int) -> int:
        """First tag line of ``chunk``."""
        return self.tags_offset + chunk * self.tag_lines * L.LINE_BYTES

    def tag_off(self, payload_offset_bytes: int) -> int:
        """The tag word of the slot starting at ``payload_offset_bytes`` (inside the chunks)."""
        rel = payload_offset_bytes - self.chunks_offset
        chunk = rel // self.chunk_bytes
        return self.tags_off(chunk) + (rel % self.chunk_bytes) // self.min_slot_bytes * 8

    @property
    def ring_pair_bytes(self) -> int:
        return (2 + math.ceil(self.ring_entries / 8)) * L.LINE_BYTES

    def ring_off(self, owner: int, sender: int) -> int:
        """Head line of the (owner, sender) ring; tail line follows, then the entries."""
        return self.rings_offset + (owner * self.max_nodes + sender) * self.ring_pair_bytes


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def tag_lines_per_chunk(chunk_bytes: int, min_slot_bytes: int) -> int:
    """Lines of slot tags one chunk needs: a word per ``min_slot_bytes``, padded to a line."""
    return math.ceil(chunk_bytes // min_slot_bytes / 8)


def sections_for(size_bytes: int, max_nodes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *,
                 min_slot_bytes: int = DEFAULT_MIN_SLOT_BYTES, num_locks: int = DEFAULT_NUM_LOCKS,
                 ring_entries: int = DEFAULT_RING_ENTRIES) -> list[SectionSpec]:
    """The sections of the lock, the manager and the allocator, "alloc.chunks" last (the rest).

    Insert other sections (the prefix index) before the last one. Metadata is sized for
    ``size_bytes // chunk_bytes`` chunks, an upper bound of what the chunk section will hold.
    Parameters travel in the sections' ``kind`` tags (chunk size, min slot size, ring entries),
    so an attacher needs nothing but the region. Raises ValueError for bad parameters.
    """
    if not _pow2(chunk_bytes) or chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes must be a power of two >= 4096, got {chunk_bytes}")
    if not _pow2(min_slot_bytes) or not 64 <= min_slot_bytes <= chunk_bytes:
        raise ValueError(f"min_slot_bytes must be a power of two in 64..chunk_bytes, got "
                         f"{min_slot_bytes}")
    if chunk_bytes // min_slot_bytes > 65535:
        raise ValueError("at most 65535 slots per chunk: raise min_slot_bytes")
    if not 1 <= num_locks <= 64:
        raise ValueError(f"num_locks must be in 1..64, got {num_locks}")
    if ring_entries < 8 or ring_entries % 8:
        raise ValueError(f"ring_entries must be a positive multiple of 8, got {ring_entries}")
    n_max = max(1, size_bytes // chunk_bytes)
    bitmap_lines = math.ceil(chunk_bytes // min_slot_bytes / 512)
    line = L.LINE_BYTES
    pair = (2 + ring_entries // 8) * line
    return [
        # the lock's sections (sizes as in sync/slots.py: locks_bytes, manager_bytes)
        SectionSpec(name="sync.locks", nbytes=num_locks * (1 + 2 * max_nodes) * line),
        SectionSpec(name="sync.manager", nbytes=(1 + max_nodes) * line),
        SectionSpec(name=SEC_META, nbytes=line + L.align_up(max_nodes * L.ALLOC_COUNT.itemsize,
                                                            line)),
        SectionSpec(name=SEC_BITMAP, nbytes=L.align_up(math.ceil(n_max / 64) * 8, line)),
        SectionSpec(name=SEC_OWNERS, nbytes=L.align_up(n_max * L.CHUNK_OWNER.itemsize, line)),
        SectionSpec(name=SEC_HEAPS, nbytes=n_max * (1 + bitmap_lines) * line, kind=min_slot_bytes),
        SectionSpec(name=SEC_RINGS, nbytes=max_nodes * max_nodes * pair, kind=ring_entries),
        SectionSpec(name=SEC_TAGS, nbytes=n_max * tag_lines_per_chunk(chunk_bytes, min_slot_bytes)
                    * line),
        SectionSpec(name=SEC_CHUNKS, nbytes=-1, align_bytes=min(chunk_bytes, 2 << 20),
                    kind=chunk_bytes),
    ]


def alloc_geometry(region: "Region") -> AllocGeometry:
    """The allocator geometry of ``region``. Raises RootNameNotFound without allocator sections."""
    meta = region.section(SEC_META)
    bitmap = region.section(SEC_BITMAP)
    owners = region.section(SEC_OWNERS)
    heaps = region.section(SEC_HEAPS)
    rings = region.section(SEC_RINGS)
    tags = region.section(SEC_TAGS)
    chunks = region.section(SEC_CHUNKS)
    chunk_bytes, min_slot, ring_entries = int(chunks.kind), int(heaps.kind), int(rings.kind)
    # the parameters travel in the sections' kind tags (sections_for): words of the region, so
    # checked like any other before the kernels compute addresses from them (a fuzzed kind of
    # 0 was a ZeroDivisionError)
    if (min_slot < L.LINE_BYTES or chunk_bytes < min_slot or chunk_bytes % min_slot
            or chunk_bytes // min_slot > 65535 or ring_entries < 8 or ring_entries % 8):
        raise RegionCorrupt(f"{region.path}: allocator parameters chunk_bytes={chunk_bytes}, "
                            f"min_slot_bytes={min_slot}, ring_entries={ring_entries} (root "
                            f"directory kind tags) are inconsistent: the root directory is "
                            f"damaged")
    mn = region.max_nodes
    bitmap_lines = math.ceil(chunk_bytes // min_slot / 512)
    tag_lines = tag_lines_per_chunk(chunk_bytes, min_slot)
    pair = (2 + ring_entries // 8) * L.LINE_BYTES
    if (meta.nbytes < L.LINE_BYTES + mn * L.ALLOC_COUNT.itemsize
            or rings.nbytes < mn * mn * pair):
        raise RegionCorrupt(f"{region.path}: allocator sections {SEC_META} ({meta.nbytes} "
                            f"bytes) or {SEC_RINGS} ({rings.nbytes} bytes) are too small for "
                            f"{mn} nodes: the root directory is damaged")
    n = min(chunks.nbytes // chunk_bytes, bitmap.nbytes * 8,
            owners.nbytes // L.CHUNK_OWNER.itemsize,
            heaps.nbytes // ((1 + bitmap_lines) * L.LINE_BYTES),
            tags.nbytes // (tag_lines * L.LINE_BYTES))
    return AllocGeometry(meta.offset_bytes, bitmap.offset_bytes, owners.offset_bytes,
                         heaps.offset_bytes, rings.offset_bytes, chunks.offset_bytes, int(n),
                         chunk_bytes, min_slot, bitmap_lines, int(rings.kind), region.max_nodes,
                         tags.offset_bytes, tag_lines)


@dataclass(frozen=True, kw_only=True)
class ChunkOwner:
    chunk: int
    owner: int | None     # node id
    owner_epoch: int
    generation: int
    claim_token: int


@dataclass(frozen=True, kw_only=True)
class Journal:
    state: int
    op: int
    node: int | None
    node_epoch: int
    token: int
    first_chunk: int
    count: int
    seq: int


@njit(cache=True, nogil=True)
def _set_owners_run(m, off, count, rec_bytes, o_owner, o_epoch, o_gen, o_token, owner_word,
                    epoch, token, gens):
    """``ChunkTable._set_owner`` for ``count`` consecutive owner records from ``off``: every
    record line invalidated, one fence; each record's generation + 1, owner, epoch and token
    stored, its line flushed; one fence. The new generations go to ``gens``. (One call instead of
    a Python call with a fence per chunk: a 256 MiB put of 64 KiB blocks claims 128 chunks.)"""
    for i in range(count):
        K.invalidate(m, off + i * rec_bytes, S_OWNER_READ)
    K.full_fence(m)
    for i in range(count):
        r = off + i * rec_bytes
        gen = K.load(m, r + o_gen) + np.uint64(1)
        K.store(m, r + o_owner, owner_word)
        K.store(m, r + o_epoch, epoch)
        K.store(m, r + o_gen, gen)
        K.store(m, r + o_token, token)
        gens[i] = np.int64(gen)
    for i in range(count):
        K.flush(m, off + i * rec_bytes, S_OWNER_FLUSH)
    K.full_fence(m)


_C_WANTED = L.ALLOC_COUNT.dtype.fields["wanted"][1]
_C_WANTED_NS = L.ALLOC_COUNT.dtype.fields["wanted_ns"][1]


@njit(cache=True)            # holds the GIL (kernels/mem.py, ``load_fresh_held``)
def asks_pending(m, first_off, rec_bytes, nodes, me, now_ns, ttl_ns):
    """Whether a node other than ``me`` has a live ask for chunks (``ChunkTable.wanted`` > 0
    for it): every count record's line invalidated, one fence, then each record's two ask
    words. What ``wanted()`` answers for a yes-or-no, without its structured arrays or a
    kernel that lets the GIL go: on the 2-core VM that look cost 9 µs alone and 60-110 µs
    inside a whole prompt's put, where a waiting thread took the GIL at the release."""
    for n in range(nodes):
        K.invalidate(m, first_off + n * rec_bytes, S_COUNT_READ)
    K.full_fence(m)
    for n in range(nodes):
        if n == me:
            continue
        r = first_off + n * rec_bytes
        if (K.load(m, r + _C_WANTED) != 0
                and now_ns - np.int64(K.load(m, r + _C_WANTED_NS)) < ttl_ns):
            return True
    return False


def _crash_point(point: str) -> None:
    """The default fault hook: a named crash point (``tract_async.crashpoints``)."""
    if CP.ARMED:
        CP.hit(point)


class ChunkTable:
    """The global chunk tier of one region, seen from one node. Mutators need the global lock
    (lock index 0) and take its ``check`` callable (``GlobalLock.check_token``) and token."""

    def __init__(self, region: "Region", *, fault_hook: Callable[[str], None] | None = None
                 ) -> None:
        self._region = region
        self.geo = alloc_geometry(region)
        self._fault = fault_hook or _crash_point

    # -- readers (no lock needed for a snapshot; fresh from memory) -----------------------------
    def _fresh(self, off: int, nbytes: int, site: int) -> np.ndarray:
        raw = np.zeros(max(nbytes, 8), dtype=np.uint8)
        K.read_bytes(self._region.mem, off, raw.ctypes.data, nbytes, site)
        return raw

    def bitmap(self) -> np.ndarray:
        """bool[nchunks]: the bitmap as memory holds it."""
        n = self.geo.nchunks
        words = self._fresh(self.geo.bitmap_offset, math.ceil(n / 64) * 8,
                            S_BITMAP_READ).view("<u8")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return bits[:n].astype(bool)

    def owners(self) -> np.ndarray:
        """Structured array of every chunk owner record."""
        n = self.geo.nchunks
        raw = self._fresh(self.geo.owners_offset, n * L.CHUNK_OWNER.itemsize, S_OWNER_READ)
        return raw[:n * L.CHUNK_OWNER.itemsize].view(L.CHUNK_OWNER.dtype)

    def owner(self, chunk: int) -> ChunkOwner:
        rec = self._fresh(self.geo.owner_off(chunk), L.CHUNK_OWNER.itemsize,
                          S_OWNER_READ)[:32].view(L.CHUNK_OWNER.dtype)[0]
        o = int(rec["owner"])
        return ChunkOwner(chunk=chunk, owner=o - 1 if o else None,
                          owner_epoch=int(rec["owner_epoch"]), generation=int(rec["generation"]),
                          claim_token=int(rec["claim_token"]))

    def generation(self, chunk: int) -> int:
        return int(K.load_fresh_held(self._region.mem,    # (a remote free's check: holds the GIL)
                                     self.geo.owner_off(chunk) + _O["generation"], S_OWNER_READ))

    def counts(self) -> np.ndarray:
        """Structured array of the per-node records (chunks, reclaimed_epoch)."""
        n = self.geo.max_nodes
        raw = self._fresh(self.geo.count_off(0), n * L.ALLOC_COUNT.itemsize, S_COUNT_READ)
        return raw[:n * L.ALLOC_COUNT.itemsize].view(L.ALLOC_COUNT.dtype)

    def wanted(self) -> np.ndarray:
        """int64[max_nodes]: chunks each node asked for and found none free (0: none), with
        asks older than ``WANT_TTL_S`` counted as 0 (the asker stopped asking)."""
        c = self.counts()
        now = time.time_ns()
        live = (now - c["wanted_ns"].astype(np.int64)) < int(WANT_TTL_S * 1e9)
        return np.where(live, c["wanted"].astype(np.int64), 0)

    def asks_other_than(self, node_id: int) -> bool:
        """Whether a node other than ``node_id`` asks for chunks now (``wanted`` > 0 for it),
        in one kernel call that keeps the GIL (``asks_pending``)."""
        g = self.geo
        return bool(asks_pending(self._region.mem, g.count_off(0), L.ALLOC_COUNT.itemsize,
                                 g.max_nodes, node_id, time.time_ns(), int(WANT_TTL_S * 1e9)))

    def set_wanted(self, node_id: int, chunks: int) -> None:
        """Record (caller holds the lock) that ``node_id`` wants ``chunks`` more chunks (0:
        satisfied): owners with spare chunks release some for it."""
        m, off = self._region.mem, self.geo.count_off(node_id)
        K.store(m, off + 16, np.uint64(chunks))
        K.store(m, off + 24, np.uint64(time.time_ns()))
        K.flush(m, off + 16, S_COUNT_FLUSH)
        K.full_fence(m)

    def reclaimed_epoch(self, node_id: int) -> int:
        return int(K.load_fresh(self._region.mem, self.geo.count_off(node_id) + 8, S_COUNT_READ))

    def journal(self) -> Journal:
        rec = self._fresh(self.geo.meta_offset, 64, S_JOURNAL_READ).view(L.ALLOC_JOURNAL.dtype)[0]
        node = int(rec["node"])
        return Journal(state=int(rec["state"]), op=int(rec["op"]), node=node - 1 if node else None,
                       node_epoch=int(rec["node_epoch"]), token=int(rec["token"]),
                       first_chunk=int(rec["first_chunk"]), count=int(rec["count"]),
                       seq=int(rec["seq"]))

    # -- primitive stores (caller holds the lock) ---------------------------------------------
    def _journal_begin(self, op: int, node: int, epoch: int, token: int, first: int,
                       count: int) -> None:
        m, off = self._region.mem, self.geo.meta_offset
        seq = int(K.load_fresh(m, off + _J["seq"], S_JOURNAL_READ))
        for name, v in (("op", op), ("node", node + 1), ("node_epoch", epoch), ("token", token),
                        ("first_chunk", first), ("count", count), ("seq", seq + 1)):
            K.store(m, off + _J[name], v)
        K.flush(m, off, S_JOURNAL_FLUSH)
        K.store_fence(m)
        K.store_flush(m, off + _J["state"], J_PENDING, S_JOURNAL_FLUSH)

    def _journal_end(self) -> None:
        K.store_flush(self._region.mem, self.geo.meta_offset + _J["state"], J_IDLE,
                      S_JOURNAL_FLUSH)

    def _set_owner(self, chunk: int, owner: int | None, epoch: int, token: int) -> int:
        """Write one owner record (generation + 1); returns the new generation."""
        return self._set_owners(chunk, 1, 0 if owner is None else owner + 1, epoch, token)[0]

    def _set_owners(self, first: int, count: int, owner_word: int, epoch: int,
                    token: int) -> list[int]:
        """Write ``count`` consecutive owner records (``_set_owners_run``); the new generations."""
        gens = np.zeros(count, dtype=np.int64)
        _set_owners_run(self._region.mem, self.geo.owner_off(first), count,
                        L.CHUNK_OWNER.itemsize, _O["owner"], _O["owner_epoch"],
                        _O["generation"], _O["claim_token"], owner_word, epoch, token, gens)
        return gens.tolist()

    def set_bit(self, chunk: int, value: bool) -> None:
        self._set_bits([chunk], value)

    def _set_bits(self, chunks: Iterable[int], value: bool) -> None:
        """Set or clear bitmap bits; each touched word read fresh, stored and flushed once."""
        m = self._region.mem
        by_word: dict[int, int] = {}
        for c in chunks:
            by_word[c // 64] = by_word.get(c // 64, 0) | (1 << (c % 64))
        for w, bits in by_word.items():
            off = self.geo.bitmap_offset + w * 8
            word = int(K.load_fresh(m, off, S_BITMAP_READ))
            word = (word | bits) if value else (word & ~bits & 0xFFFFFFFFFFFFFFFF)
            K.store(m, off, np.uint64(word))
            K.flush(m, off, S_BITMAP_FLUSH)
        K.full_fence(m)

    def _write_counts(self, want: dict[int, int]) -> None:
        m = self._region.mem
        cur = self.counts()
        for node, n in want.items():
            if int(cur[node]["chunks"]) != n:
                K.store(m, self.geo.count_off(node), n)
                K.flush(m, self.geo.count_off(node), S_COUNT_FLUSH)
        K.full_fence(m)

    def recount(self) -> None:
        """Rewrite every node's chunk count from the owner table."""
        own = self.owners()["owner"].astype(np.int64)
        want = {j: int(np.count_nonzero(own == j + 1)) for j in range(self.geo.max_nodes)}
        self._write_counts(want)

    # -- batches --------------------------------------------------------------------------------
    def find_free(self) -> int | None:
        """Index of a free chunk by the bitmap, or None."""
        free = np.flatnonzero(~self.bitmap())
        return int(free[0]) if free.size else None

    def find_free_run(self, want: int) -> tuple[int, int] | None:
        """(first, count): the first free chunk and how many free chunks follow it contiguously
        (at most ``want``), or None when no chunk is free."""
        bits = self.bitmap()
        free = np.flatnonzero(~bits)
        if not free.size:
            return None
        first = int(free[0])
        count = 1
        while count < want and first + count < bits.size and not bits[first + count]:
            count += 1
        return first, count

    def claim(self, node_id: int, epoch: int, token: int, check: Callable[[], None]
              ) -> tuple[int, int] | None:
        """Claim one free chunk for ``node_id``: (chunk, generation), or None when full.

        Raises LockRevoked (from ``check``) before any store, or after the batch (then the
        caller must not use the chunk; it stays recorded as the node's, and the exception's
        ``orphaned`` lists it: the caller gives it back at its next hold, ``claim_many``).
        """
        got = self.claim_many(node_id, epoch, token, check, 1)
        return got[0] if got else None

    def claim_many(self, node_id: int, epoch: int, token: int, check: Callable[[], None],
                   want: int) -> list[tuple[int, int]]:
        """Claim up to ``want`` free chunks for ``node_id`` as one journaled batch: a contiguous
        run from the first free chunk (the journal records a run: first, count). Returns
        [(chunk, generation)], empty when nothing is free. Raises as ``claim``.

        Large puts need many chunks at once (a 256 MiB put of 64 KiB blocks: 128 chunks of 2 MiB);
        one batch costs one journal round and one bitmap/count update instead of one each."""
        check()
        run = self.find_free_run(max(1, want))
        if run is None:
            return []
        first, count = run
        self._fault("claim.found")
        check()                 # before every store of the batch ("Fenced steps")
        self._journal_begin(OP_CLAIM, node_id, epoch, token, first, count)
        self._fault("claim.journaled")
        check()
        gens = self._set_owners(first, count, node_id + 1, epoch, token)
        self._fault("claim.owner")
        check()
        self._set_bits(range(first, first + count), True)
        self._fault("claim.bitmap")
        check()
        cur = int(self.counts()[node_id]["chunks"])
        self._write_counts({node_id: cur + count})
        check()
        self._journal_end()
        self._fault("claim.done")
        got = list(zip(range(first, first + count), gens))
        try:
            check()
        except LockRevoked as e:
            # revoked while the batch ran (a holder slow, not dead: issue 36): the batch is
            # complete and IDLE, so no recovery undoes it, and while this node stays live no
            # reclaim takes these chunks back either. The caller must not carve them (its
            # token is gone) but must not forget them: it releases them at its next hold
            # (``Allocator._release_orphans``); were they forgotten, they would leak until
            # the node left (the crash-point test's "4 leaked chunks" on a loaded machine)
            e.orphaned = tuple(got)
            raise
        return got

    def release(self, chunk: int, node_id: int, epoch: int, token: int,
                check: Callable[[], None]) -> None:
        """Give chunk ``chunk`` of ``node_id`` back to the global pool."""
        check()
        self._journal_begin(OP_RELEASE, node_id, epoch, token, chunk, 1)
        self._fault("release.journaled")
        check()
        self._release_one(chunk)
        check()
        cur = int(self.counts()[node_id]["chunks"])
        self._write_counts({node_id: max(0, cur - 1)})
        check()
        self._journal_end()

    def _release_one(self, chunk: int) -> None:
        self._set_owner(chunk, None, 0, 0)
        self.set_bit(chunk, False)

    def recover_journal(self, check: Callable[[], None]) -> str | None:
        """Finish or undo a batch left PENDING by a dead or revoked holder; what was done."""
        j = self.journal()
        if j.state != J_PENDING:
            return None
        check()
        if j.op == OP_CLAIM:
            for c in range(j.first_chunk, min(j.first_chunk + j.count, self.geo.nchunks)):
                check()
                o = self.owner(c)
                if o.owner == j.node and o.claim_token == j.token:
                    self._release_one(c)
                elif o.owner is None:
                    self.set_bit(c, False)
            done = f"rolled back claim of chunk {j.first_chunk} by node {j.node}"
        elif j.op == OP_RELEASE:
            for c in range(j.first_chunk, min(j.first_chunk + j.count, self.geo.nchunks)):
                check()
                if self.owner(c).owner == j.node:
                    self._release_one(c)
                else:
                    self.set_bit(c, False)
            done = f"completed release of chunk {j.first_chunk} by node {j.node}"
        elif j.op == OP_RECLAIM and j.node is not None:
            self._reclaim_node(j.node, j.node_epoch, check)
            done = f"completed reclaim of node {j.node} (epoch {j.node_epoch})"
        else:
            done = f"cleared a journal with unknown op {j.op}"
        check()
        self.recount()
        check()
        self._journal_end()
        return done

    def dead_owners(self, nodes: list["NodeInfo"]) -> dict[int, set[int]]:
        """{node id: {epochs}} of chunk owners that are not live with that epoch (``dead``:
        see ``NodeInfo.dead``; pass ``nodes.all(confirm=False)`` for the snapshot verdict)."""
        own = self.owners()
        owner = own["owner"].astype(np.int64)
        held = owner != 0
        node = owner[held] - 1
        epoch = own["owner_epoch"][held].astype(np.int64)
        # the epoch each node id is live with (-1: not live, or beyond the table)
        live_epoch = np.array([-1 if n.dead else n.epoch for n in nodes] + [-1], dtype=np.int64)
        # a damaged owner word may name no node (or be negative as int64): it maps to -1 too
        node_ix = np.where((node < 0) | (node >= len(nodes)), len(nodes), node)
        dead = live_epoch[node_ix] != epoch
        out: dict[int, set[int]] = {}
        for n, ep in set(zip(node[dead].tolist(), epoch[dead].tolist())):
            out.setdefault(n, set()).add(ep)
        return out

    def reclaim_dead(self, nodes: list["NodeInfo"], token: int, check: Callable[[], None],
                     on_reclaim: Callable[[int, list[tuple[int, int]]], None] | None = None
                     ) -> dict[int, int]:
        """Release every chunk of a dead incarnation; {node id: chunks reclaimed}."""
        done: dict[int, int] = {}
        for node, epochs in sorted(self.dead_owners(nodes).items()):
            for ep in sorted(epochs):
                check()
                spans = [(self.geo.chunk_off(c), self.geo.chunk_bytes)
                         for c in self._chunks_of(node, ep)]
                if on_reclaim is not None:
                    on_reclaim(node, spans)
                self._fault("reclaim.hooked")
                check()
                self._journal_begin(OP_RECLAIM, node, ep, token, 0, 0)
                done[node] = done.get(node, 0) + self._reclaim_node(node, ep, check)
                check()
                self.recount()
                check()
                self._journal_end()
        return done

    def _chunks_of(self, node: int, epoch: int) -> list[int]:
        own = self.owners()
        return [int(c) for c in np.flatnonzero((own["owner"] == node + 1)
                                               & (own["owner_epoch"] == epoch))]

    def _reclaim_node(self, node: int, epoch: int, check: Callable[[], None]) -> int:
        chunks = self._chunks_of(node, epoch)
        for c in chunks:
            check()
            self._release_one(c)
        m, off = self._region.mem, self.geo.count_off(node) + 8
        check()
        if int(K.load_fresh(m, off, S_COUNT_READ)) < epoch:
            K.store_flush(m, off, epoch, S_COUNT_FLUSH)
        return len(chunks)
