"""A read's checks around its copy: the snapshot before (wait, state, bounds, namespace) and
the revalidation after, with the read's counters and LRU touches.

Steps 1-2 and 4 of the lock-free read of ``region/index.py``, for one node (``stores/blocks.py``
has the whole protocol): ``prepare_read`` snapshots the entries of a read's keys -- waiting for
blocks or a layer through ``ReadyWaits`` -- and checks that each block is there, has the layer,
belongs to this layout's namespace and has payload bounds of this layout; the copy back-end
moves the bytes; ``validate_read`` re-reads every entry and slot tag and fails the whole read
(BlockEvicted: a miss) when any block changed meanwhile (docs/design.md invariant 6). A
layer-streamed get's later layers take the slots found by the earlier ones (``known``).

Why a module of its own (issue 37): these were nine methods of the block lifecycle, tied to
the put side only by the stats and the pre-claim task's read reports; here they depend on the
index, the waits and the counters, and nothing on this side calls back into the lifecycle.
"""
from __future__ import annotations

import numpy as np

from ..config import EngineConfig
from ..errors import BlockEvicted
from ..keys import KeyBatch, keys_to_words
from ..region import Region
from ..region import cpumarks
from ..region import index as ix
from ..region.chunks import alloc_geometry
from ..region.index import SNAP_NBYTES, SNAP_POFF, SNAP_SLOT, SNAP_VERSION
from ..region.layout import INDEX_FLAG_NS_MASK as NS_MASK, INDEX_FLAG_NS_SHIFT as NS_SHIFT
from .layouts import LayoutGuard
from .preclaim import PreClaimer
from .readiness import SMALL_READ, ReadyWaits, check_available, rows_available
from .snapcheck import rows_fine
from .stats import StoreStats
from .touches import TouchLog

KNOWN_ROWS = 8
"""Layer reads whose slots ``prepare_read`` remembers (a few requests decoding at once)."""


class ReadSide:
    """Before and after a read's copy, for one node over one region (module docstring).
    Created and owned by the ``BlockLifecycle``."""

    def __init__(self, cfg: EngineConfig, region: Region, index: ix.PrefixIndex,
                 waits: ReadyWaits, stats: StoreStats, preclaimer: PreClaimer,
                 touches: TouchLog) -> None:
        self.layout = cfg.layout
        self.region = region
        self.index = index
        self.ageo = alloc_geometry(region)
        self.waits = waits
        self.stats = stats
        self.preclaimer = preclaimer
        self.touches = touches
        self.layouts: LayoutGuard | None = None
        """The check of the blocks' namespaces; None: not checked (no Engine). Set by the
        lifecycle's ``use_layouts``."""
        self.validate_reads = True
        """Re-validate versions after each copy (invariant 6). Only the torn-read stress test's
        negative control turns this off, to show that without it wrong bytes get through."""
        self.last_words: tuple[list[bytes], list[bytes], np.ndarray] | None = None
        """``read_words``' cache: the key list last read, a copy of its keys, their words."""
        self.known: list[tuple[list[bytes], np.ndarray]] = []
        """The last ``KNOWN_ROWS`` layer reads of more than ``SMALL_READ`` blocks that found
        every block, newest first: a copy of the key list and the snapshot (``prepare_read``'s
        known-slot path). Found by content (a list comparison: identity per key first), not by
        the list's identity: a decode worker's requests interleave, and each operation's
        checked key list is a new one once another list was checked in between."""
        self._marks: cpumarks.CpuMarks | None = None
        """``cpu_marks``, once made."""

    def read_words(self, keys: list[bytes]) -> np.ndarray:
        """``keys_to_words(keys)`` for a read, from a one-entry cache when ``keys`` is the list
        the last read got, with the same keys in it (one C-level list comparison): a
        layer-streamed get reads the same keys once per layer, and their words cost ~60 µs per
        2048 keys on the 2-core VM, ~2.5 µs for one key (a fifth of a one-block layer read's
        metadata there). The cached array is only ever read (by the kernels)."""
        c = self.last_words
        if c is not None and c[0] is keys and c[1] == keys:
            return c[2]
        words = keys_to_words(keys)
        self.last_words = (keys, list(keys), words)
        return words

    async def prepare_read(self, keys: list[bytes], layer: int | None,
                           timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-2 of a lock-free read (index.py): snapshot the entries (waiting up to
        ``timeout`` for blocks or the layer), check state and payload bounds. Returns the key
        words and the snapshot (rows: slot, version, state, payload offset, nbytes, layer bits,
        flags), which ``validate_read`` takes after the copy. Raises BlockNotFound,
        LayerNotReady, TransferTimeout, BlockEvicted, LayoutMismatch (a block of a namespace
        of another layout: ``stores/layouts.py``)."""
        self.preclaimer.read_started()
        words = self.read_words(keys)
        g = self.ageo
        end = g.chunks_offset + g.nchunks * g.chunk_bytes
        known = self._known_rows(keys) if layer is not None else None
        if known is not None:
            # a later layer of blocks read recently (a layer-streamed get): their entries'
            # layer bits afresh at the slots found then, a line a block, instead of a lookup
            # per block (whatever changed since is caught by this read's revalidation: see
            # ``PrefixIndex.refresh_layers``); anything not fine takes the whole path below
            snap = self._refreshed(known, layer)
            if snap is not None:
                return words, snap
        if timeout is not None and timeout > 0:
            snap = await self.waits.wait(words, self.waits.first_look(words, layer), layer,
                                         timeout)
        else:
            snap = self.index.snapshot(words)
        if snap.shape[0] <= SMALL_READ:
            # a few blocks: the same checks on Python ints (each numpy op below costs ~1 µs; a
            # one-block layer read through numpy cost ~22 µs on the 2-core VM, ~4 µs this way)
            rows = snap.tolist()
            bb, lo = self.layout.block_bytes, g.chunks_offset
            if rows_available(rows, layer):
                if self.layouts is not None:       # before the bounds: another layout's block
                    self.layouts.check_rows(keys, rows)         # has other bounds too
                for i, r in enumerate(rows):
                    poff, nb = r[SNAP_POFF], r[SNAP_NBYTES]
                    if nb != bb or poff < lo or poff + nb > end:
                        self.stats.validation_failures += 1
                        raise BlockEvicted(f"block {i} ({keys[i][:8].hex()}…) has payload "
                                           f"bounds [{poff}, +{nb}) that do not fit this "
                                           f"layout: changed during the read; treat as a miss")
                return words, snap
        lay = self.layouts
        tag, mask = (lay.tag, NS_MASK) if lay is not None else (0, 0)
        if rows_fine(snap, -1 if layer is None else layer, self.layout.block_bytes,
                     g.chunks_offset, end, tag, NS_SHIFT, mask):
            if layer is not None:           # the next layer may take the known slots
                self._remember_rows(keys, snap)
            return words, snap              # the common case in one pass (stores/snapcheck.py)
        check_available(keys, snap, layer, self.stats)
        if self.layouts is not None:
            self.layouts.check_snapshot(keys, snap)
        bad = np.flatnonzero((snap[:, SNAP_NBYTES] != self.layout.block_bytes) | (snap[:, SNAP_POFF] < g.chunks_offset)
                             | (snap[:, SNAP_POFF] > end - self.layout.block_bytes))  # no wrap
        if bad.size:
            i = int(bad[0])
            self.stats.validation_failures += 1
            raise BlockEvicted(f"block {i} ({keys[i][:8].hex()}…) has payload bounds "
                               f"[{snap[i, SNAP_POFF]}, +{snap[i, SNAP_NBYTES]}) that do not fit this layout: "
                               f"changed during the read; treat as a miss")
        return words, snap

    def prepare_known(self, rows: np.ndarray, layer: int) -> np.ndarray | None:
        """Steps 1-2 of a later layer's read of blocks whose snapshot the caller kept from the
        first layer (``rows``: a CUDA layer stream's, ``cuda/layerstream.py``, of any size):
        the known-slot path of ``prepare_read`` without finding the rows by their keys. The
        refreshed copy, or None when some block is not fine for ``layer`` yet (the caller then
        takes ``prepare_read``, which waits or says what is wrong)."""
        self.preclaimer.read_started()
        return self._refreshed(rows, layer)

    def read_seen(self) -> None:
        """Steps 1-2 of a later layer's read that a validated read of the same snapshot saw
        published for every block (``cuda/layerstream.py``, "Seen layers"): no entry to look
        at; counted, and the read is announced as ``prepare_known`` does."""
        self.preclaimer.read_started()
        self.stats.seen_layer_reads += 1

    def _refreshed(self, rows: np.ndarray, layer: int) -> np.ndarray | None:
        """A copy of ``rows`` with each entry's layer bits and flags afresh, if every block is
        fine for ``layer`` (``rows_fine``: present, the layer in, this namespace, in bounds)."""
        snap = rows.copy()
        self.index.refresh_layers(snap)
        g = self.ageo
        lay = self.layouts
        tag, mask = (lay.tag, NS_MASK) if lay is not None else (0, 0)
        if not rows_fine(snap, layer, self.layout.block_bytes, g.chunks_offset,
                         g.chunks_offset + g.nchunks * g.chunk_bytes, tag, NS_SHIFT, mask):
            return None
        self.stats.known_slot_reads += 1
        return snap

    def _known_rows(self, keys: list[bytes]) -> np.ndarray | None:
        """The remembered snapshot of exactly ``keys`` (``known``), or None."""
        n = len(keys)
        for ks, snap in self.known:
            if len(ks) == n and ks[0] is keys[0] and ks == keys:
                return snap
        return None

    def _remember_rows(self, keys: list[bytes], snap: np.ndarray) -> None:
        rows = [e for e in self.known if not (len(e[0]) == len(keys) and e[0] == keys)]
        rows.insert(0, (list(keys), snap.copy()))
        del rows[KNOWN_ROWS:]
        self.known = rows

    def validate_read(self, kb: KeyBatch, snap: np.ndarray, nbytes: int, *,
                      cpu: bool = True, layer: int | None = None) -> None:
        """Step 4 of a read, after the copy has completed (on a GPU: after its DMA): every
        block must still be the one snapshotted (entry and slot tag, ``PrefixIndex.revalidate``)
        or the whole read is a miss. Counts the read and records LRU touches. ``cpu``: this
        host's CPU copied the bytes (False for a device's DMA): its cached lines are marked
        (``region/cpumarks.py``), of ``layer`` only or of whole blocks (None). Raises
        BlockEvicted (the output is not to be trusted)."""
        keys, words = kb.keys, kb.words
        n = len(keys)
        slots, versions = snap[:, SNAP_SLOT], snap[:, SNAP_VERSION]
        if self.validate_reads:         # (revalidate writes every ok[i])
            ok = np.empty(n, dtype=np.bool_)
            bad = self.index.revalidate(slots, versions, snap[:, SNAP_POFF], words, ok)
        else:
            ok, bad = np.ones(n, dtype=np.bool_), 0
        self.count_read(keys, ok, int(bad), nbytes, slots, versions,
                        snap[:, SNAP_POFF] if cpu else None, layer)

    @property
    def cpu_marks(self) -> cpumarks.CpuMarks:
        """This host's record of the payload its CPUs may cache (made on first use)."""
        cm = self._marks
        if cm is None:
            r = self.region
            cm = self._marks = cpumarks.CpuMarks(
                cpumarks.sidecar_path(r.path, r.uuid.hex), r.size_bytes)
        return cm

    def count_read(self, keys: list[bytes], ok: np.ndarray, bad: int, nbytes: int,
                   slots: np.ndarray, versions: np.ndarray,
                   cpu_poffs: np.ndarray | None = None, layer: int | None = None) -> None:
        """After a read's revalidation (``bad`` blocks failed, ``ok`` per block): count it,
        and either raise BlockEvicted or record the LRU touches. ``cpu_poffs``: the payload
        offsets this host's CPU read, also when the read failed (its lines are cached all the
        same); None for a DMA's read. What is marked (``region/cpumarks.py``) is what was read:
        ``layer``'s bytes of each block, or whole blocks (None). (Whole blocks for a layer read
        marked 32x the pages it touched for Llama-3-8B: 154 µs of a 213-block layer get on the
        2-core VM, and every later GPU read of the block's other layers invalidated them.)"""
        if cpu_poffs is not None and len(cpu_poffs):
            lay = self.layout
            if layer is None:
                self.cpu_marks.mark(cpu_poffs, 0, lay.block_bytes)
            else:
                self.cpu_marks.mark(cpu_poffs, layer * lay.layer_bytes, lay.layer_bytes)
        st, n = self.stats, len(keys)
        st.gets += 1
        if bad:
            self.known = []            # the next reads look their keys up again
            st.validation_failures += 1
            st.misses += bad
            first = int(np.flatnonzero(~ok)[0])
            raise BlockEvicted(f"{bad} of {n} blocks were evicted while being read (first: "
                               f"block {first}, {keys[first][:8].hex()}…); the output is not "
                               f"trusted: treat as a miss")
        st.hits += n
        st.blocks_read += n
        st.bytes_got += nbytes
        self.touch(slots, versions)

    def touch(self, slots: np.ndarray, versions: np.ndarray) -> None:
        """Record reads for the approximate LRU, stamped in the region at the next maintenance
        or locked reservation, without the lock (``stores/touches.py``)."""
        self.touches.record(slots, versions)
