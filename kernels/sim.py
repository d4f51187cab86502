"""The incoherent-memory backend: a per-node private write-back cache, modelled in software.

``/dev/shm`` is coherent, so on this machine a missing flush or invalidate passes every ordinary
test. This model makes them visible. Each ``Mem`` built with ``backend="sim"`` owns a private cache
(a node, i.e. a host of the rack); its state lives in process-private numpy arrays, while the
backing memory is the real shared mapping.

What it models:
* Loads hit the cached copy of a line, however stale, until the line is invalidated (or evicted).
* Stores are write-allocate into the private copy; memory sees nothing until a flush, a write-back
  (``clwb``), an eviction, or a random early write-back.
* A write-back writes the *whole* 64-byte line, so two nodes that write different words of one
  line lose each other's update (docs/design.md invariant 2).
* Dirty lines are written back early at random (seeded xorshift, probability per access), and a
  line whose slot is needed by another line (direct-mapped, ``cache_lines`` slots) is evicted.
* Non-temporal stores bypass the cache (the line is written back and dropped first, as hardware
  does for a cached line), so they need no flush, only a fence.

What it does not model: store-buffer reordering (x86-TSO store->load), so fences are no-ops here
and their placement is argued in comments and checked by disassembly instead; partial-line tearing
of a single 64-bit word (aligned 64-bit stores are single-copy atomic on x86 and CXL); latency.

Layout of the private state (not on the region):
``tags[slot]`` int64 line index cached in the slot or -1; ``lines[slot, 0:8]`` uint64 words;
``dirty[slot]`` uint8; ``ctl`` uint64[8]: 0 rng state, 1 early-eviction threshold (out of 2**32),
2 write-backs, 3 early evictions, 4 fills, 5 conflict evictions.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .intrinsics import aload64, astore64
from .memfields import (MEM_BASE_ADDR, MEM_CACHE_LINES, MEM_CTL_ADDR, MEM_DIRTY_ADDR,
                        MEM_LINES_ADDR, MEM_TAGS_ADDR)
from .intrinsics import load_u8 as _load_byte
from .intrinsics import store_u8 as _store_byte

CTL_RNG = 0
CTL_THRESHOLD = 1
CTL_WRITEBACKS = 2
CTL_EARLY = 3
CTL_FILLS = 4
CTL_CONFLICTS = 5


def new_state(cache_lines: int, seed: int, evict_prob: float) -> tuple[np.ndarray, np.ndarray,
                                                                        np.ndarray, np.ndarray]:
    """Fresh private cache arrays: (tags, lines, dirty, ctl). ``cache_lines`` must be a power of 2."""
    if cache_lines <= 0 or cache_lines & (cache_lines - 1):
        raise ValueError(f"cache_lines must be a power of two, got {cache_lines}")
    if not 0.0 <= evict_prob <= 1.0:
        raise ValueError(f"evict_prob must be in [0, 1], got {evict_prob}")
    tags = np.full(cache_lines, -1, dtype=np.int64)
    lines = np.zeros((cache_lines, 8), dtype=np.uint64)
    dirty = np.zeros(cache_lines, dtype=np.uint8)
    ctl = np.zeros(8, dtype=np.uint64)
    ctl[CTL_RNG] = np.uint64((seed * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D) & (2**64 - 1) or 1)
    ctl[CTL_THRESHOLD] = np.uint64(int(evict_prob * 2**32))
    return tags, lines, dirty, ctl


# The private state is reached through its addresses (``m[MEM_TAGS_ADDR]`` ...), not as arrays: a
# Mem that carried arrays made Numba reference-count them around every inlined word access
# (mem.py, "Why the Mem holds only integers").


@njit(cache=True, nogil=True, forceinline=True)
def _tag(m, slot):
    return np.int64(aload64(np.uint64(m[MEM_TAGS_ADDR]) + np.uint64(slot * 8)))


@njit(cache=True, nogil=True, forceinline=True)
def _set_tag(m, slot, line):
    astore64(np.uint64(m[MEM_TAGS_ADDR]) + np.uint64(slot * 8), np.uint64(np.int64(line)))


@njit(cache=True, nogil=True, forceinline=True)
def _word(m, slot, w):
    return aload64(np.uint64(m[MEM_LINES_ADDR]) + np.uint64((slot * 8 + w) * 8))


@njit(cache=True, nogil=True, forceinline=True)
def _set_word(m, slot, w, value):
    astore64(np.uint64(m[MEM_LINES_ADDR]) + np.uint64((slot * 8 + w) * 8), np.uint64(value))


@njit(cache=True, nogil=True, forceinline=True)
def _dirty(m, slot):
    return _load_byte(np.uint64(m[MEM_DIRTY_ADDR]) + np.uint64(slot))


@njit(cache=True, nogil=True, forceinline=True)
def _set_dirty(m, slot, value):
    _store_byte(np.uint64(m[MEM_DIRTY_ADDR]) + np.uint64(slot), np.uint8(value))


@njit(cache=True, nogil=True, forceinline=True)
def _ctl(m, i):
    return aload64(np.uint64(m[MEM_CTL_ADDR]) + np.uint64(i * 8))


@njit(cache=True, nogil=True, forceinline=True)
def _set_ctl(m, i, value):
    astore64(np.uint64(m[MEM_CTL_ADDR]) + np.uint64(i * 8), np.uint64(value))


@njit(cache=True, nogil=True, forceinline=True)
def _count(m, i):
    _set_ctl(m, i, _ctl(m, i) + np.uint64(1))


@njit(cache=True, nogil=True, forceinline=True)
def _slot_of(m, line_index):
    h = np.uint64(line_index) * np.uint64(0x9E3779B97F4A7C15)
    return np.int64((h >> np.uint64(40)) & np.uint64(m[MEM_CACHE_LINES] - 1))


@njit(cache=True, nogil=True)
def sim_writeback_slot(m, slot):
    """Write the whole cached line back to memory (all 8 words, stale ones included)."""
    line = _tag(m, slot)
    if line >= 0 and _dirty(m, slot) != 0:
        addr = np.uint64(m[MEM_BASE_ADDR]) + np.uint64(line) * np.uint64(64)
        for w in range(8):
            astore64(addr + np.uint64(8 * w), _word(m, slot, w))
        _set_dirty(m, slot, 0)
        _count(m, CTL_WRITEBACKS)


@njit(cache=True, nogil=True)
def _maybe_early_evict(m):
    x = _ctl(m, CTL_RNG)
    x ^= x << np.uint64(13)
    x ^= x >> np.uint64(7)
    x ^= x << np.uint64(17)
    _set_ctl(m, CTL_RNG, x)
    if (x & np.uint64(0xFFFFFFFF)) < _ctl(m, CTL_THRESHOLD):
        slot = np.int64((x >> np.uint64(32)) & np.uint64(m[MEM_CACHE_LINES] - 1))
        if _tag(m, slot) >= 0 and _dirty(m, slot) != 0:
            sim_writeback_slot(m, slot)
            _set_tag(m, slot, -1)
            _count(m, CTL_EARLY)


@njit(cache=True, nogil=True)
def _fill(m, line_index):
    slot = _slot_of(m, line_index)
    if _tag(m, slot) != line_index:
        if _tag(m, slot) >= 0:
            sim_writeback_slot(m, slot)
            _count(m, CTL_CONFLICTS)
        addr = np.uint64(m[MEM_BASE_ADDR]) + np.uint64(line_index) * np.uint64(64)
        for w in range(8):
            _set_word(m, slot, w, aload64(addr + np.uint64(8 * w)))
        _set_tag(m, slot, line_index)
        _set_dirty(m, slot, 0)
        _count(m, CTL_FILLS)
    return slot


@njit(cache=True, nogil=True)
def sim_load(m, offset_bytes):
    """Load a word through the private cache (stale if the line was cached earlier)."""
    _maybe_early_evict(m)
    slot = _fill(m, offset_bytes >> 6)
    return _word(m, slot, (offset_bytes >> 3) & 7)


@njit(cache=True, nogil=True)
def sim_store(m, offset_bytes, value):
    """Store a word into the private cache only (write-allocate); memory is unchanged."""
    _maybe_early_evict(m)
    slot = _fill(m, offset_bytes >> 6)
    _set_word(m, slot, (offset_bytes >> 3) & 7, value)
    _set_dirty(m, slot, 1)


@njit(cache=True, nogil=True)
def sim_flush(m, offset_bytes, keep):
    """Write the line back if dirty; drop it unless ``keep`` (clwb keeps, clflush drops)."""
    line = offset_bytes >> 6
    slot = _slot_of(m, line)
    if _tag(m, slot) == line:
        sim_writeback_slot(m, slot)
        if not keep:
            _set_tag(m, slot, -1)


@njit(cache=True, nogil=True)
def sim_store_nt(m, offset_bytes, value):
    """Non-temporal word store: a cached copy of the line is written back and dropped (as
    hardware does), then the word goes straight to memory."""
    line = offset_bytes >> 6
    slot = _slot_of(m, line)
    if _tag(m, slot) == line:
        sim_writeback_slot(m, slot)
        _set_tag(m, slot, -1)
    astore64(np.uint64(m[MEM_BASE_ADDR]) + np.uint64(offset_bytes), np.uint64(value))


@njit(cache=True, nogil=True)
def sim_read_bytes(m, offset_bytes, dst_addr, nbytes):
    """Copy region bytes to private memory through the cache model (cached lines are stale)."""
    end = offset_bytes + nbytes
    pos = offset_bytes
    while pos < end:
        line = pos >> 6
        slot = _fill(m, line)
        line_end = min((line + 1) << 6, end)
        while pos < line_end:
            word = _word(m, slot, (pos >> 3) & 7)
            byte = (word >> np.uint64(8 * (pos & 7))) & np.uint64(0xFF)
            _store_byte(dst_addr + np.uint64(pos - offset_bytes), byte)
            pos += 1


@njit(cache=True, nogil=True)
def sim_write_bytes_nt(m, offset_bytes, src_addr, nbytes):
    """Non-temporal write: cached copies are written back and dropped, then memory is written."""
    end = offset_bytes + nbytes
    line = offset_bytes >> 6
    while (line << 6) < end:
        slot = _slot_of(m, line)
        if _tag(m, slot) == line:
            sim_writeback_slot(m, slot)
            _set_tag(m, slot, -1)
        line += 1
    # memory itself: word-wise where aligned, bytes at the edges
    pos = offset_bytes
    while pos < end:
        if (pos & 7) == 0 and pos + 8 <= end:
            word = np.uint64(0)
            for b in range(8):
                word |= np.uint64(_load_byte(src_addr + np.uint64(pos - offset_bytes + b))) << np.uint64(8 * b)
            astore64(np.uint64(m[MEM_BASE_ADDR]) + np.uint64(pos), word)
            pos += 8
        else:
            _store_byte(np.uint64(m[MEM_BASE_ADDR]) + np.uint64(pos),
                        _load_byte(src_addr + np.uint64(pos - offset_bytes)))
            pos += 1

