"""A batch's layer publish writes whole entry lines from the words it recorded at the
reservation (``index.reserve_batch_counted``'s ``lines``, ``index.publish_layers_lines``):
what reaches memory must be, word for word, what the word-by-word publish
(``index.publish_layers``) leaves there, at every layer.

Under the incoherent backend with evictions off, the buffer itself holds only what was flushed
or stored non-temporally -- what another host would read -- so comparing the two buffers
compares what the two publishes made visible.
"""
from __future__ import annotations

import mmap

import numpy as np
import pytest

import tract_kernels as K
from tract_async.region import index as ix
from tract_async.stores import doorbell as db

CAP, LANES, PROBE, LANE = 64, 4, 16, 1
EOFF = 4096                                    # the entries follow a header page (lane lines)
LOFF = EOFF - 4096 + 128 + 64 * LANE           # this lane's counter line
MASK = CAP - 1
TGEO = np.full(6, -1, dtype=np.int64)          # an index without an allocator: no slot tags
LAYERS = 3
ALL_LO = (1 << LAYERS) - 1
N = 5
NOW, PRODUCER, FLAGS, DEADLINE = 123_456_789, 7, 1 | (3 << 32), 987_654_321


def _keys() -> np.ndarray:
    """N keys, one a home group, with every word wide (real keys are hashes: a word that
    passed through a float on its way to memory would lose its low bits and show)."""
    high = 0xF1E2D3C4B5A6 << 16
    return np.array([[high | (g * LANES) | (t << 8), 0x9E3779B97F4A7C15 ^ t, high | t, ~t & 0xFFFF_FFFF_FFFF_FFFF]
                     for g, t in zip(range(N), range(11, 11 + N))], dtype=np.uint64)


def _buf() -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, EOFF + CAP * ix.ENTRY_BYTES), dtype=np.uint8)


def _reserve(buf: np.ndarray, record: bool) -> tuple[K.Mem, np.ndarray, np.ndarray]:
    """Node ``LANE`` reserves N keys (one call, as ``stores/reservation.py`` makes it): its
    Mem, the slots, and the record (no rows when ``record`` is False)."""
    m = K.make_mem(buf, "sim", seed=1, evict_prob=0.0)
    ix.clear_lane(m, EOFF, MASK, LANES, LANE)
    keys = _keys()
    ainfo = np.array([[8192 + 4096 * i, 4096, LANE | (2 << 16), 40 + i] for i in range(N)],
                     dtype=np.uint64)
    out = np.zeros((N, 3), dtype=np.int64)
    lines = np.zeros((N if record else 0, ix.ENTRY_WORDS), dtype=np.uint64)
    assert ix.reserve_batch_counted(m, LOFF, EOFF, TGEO, MASK, PROBE, LANES, LANE, keys, ainfo,
                                    NOW, PRODUCER, FLAGS, DEADLINE, out, lines)
    assert (out[:, 0] >= 0).all()
    return m, out[:, 0].copy(), lines


def _entries(buf: np.ndarray) -> np.ndarray:
    return buf[EOFF:].view(np.uint64).copy()


@pytest.mark.parametrize("corrupt", [False, True])
def test_whole_line_publish_leaves_what_the_word_publish_leaves(corrupt: bool) -> None:
    """Layer by layer (RESERVED with growing layer bits, then READY), both buffers match in
    every word; ``corrupt``: a record with one wrong word (the producer's clock) shows."""
    ref_buf, new_buf = _buf(), _buf()
    ref, ref_slots, _ = _reserve(ref_buf, record=False)
    new, slots, lines = _reserve(new_buf, record=True)
    assert np.array_equal(slots, ref_slots)
    assert np.array_equal(_entries(ref_buf), _entries(new_buf))   # the record changes nothing
    assert (lines[:, ix.W_STATE] == ix.RESERVED).all()
    if corrupt:
        lines[2, ix.E_LAST // 8] ^= 1
    lo = 0
    for layer in range(LAYERS):
        ix.publish_layers(ref, EOFF, ref_slots, 1 << layer, 0, ALL_LO, 0)
        lo |= 1 << layer
        assert db.publish_lines_and_look(new, EOFF, slots, lines, lo, 0, ALL_LO, 0, -1, 0) == 0
        same = np.array_equal(_entries(ref_buf), _entries(new_buf))
        assert same is not corrupt, layer
    ent = _entries(new_buf).reshape(CAP, ix.ENTRY_WORDS)[slots]
    assert (ent[:, ix.W_STATE] == ix.READY).all() and (ent[:, ix.W_LLO] == ALL_LO).all()


def test_a_reader_sees_the_layers_then_ready() -> None:
    """Another node's snapshot, after each layer: the key RESERVED with that layer's bits, then
    READY with all of them (the fence between line 1 and line 0 orders them)."""
    buf = _buf()
    m, slots, lines = _reserve(buf, record=True)
    reader = K.make_mem(buf, "sim", seed=2, evict_prob=0.0)
    keys = _keys()
    snap = np.zeros((N, ix.SNAP_COLS), dtype=np.int64)
    lo = 0
    for layer in range(LAYERS):
        lo |= 1 << layer
        db.publish_lines_and_look(m, EOFF, slots, lines, lo, 0, ALL_LO, 0, -1, 0)
        ix.snapshot_batch(reader, EOFF, MASK, PROBE, LANES, keys, snap)
        assert np.array_equal(snap[:, ix.SNAP_SLOT], slots)
        want = ix.READY if layer == LAYERS - 1 else ix.RESERVED
        assert (snap[:, ix.SNAP_STATE] == want).all(), (layer, snap[:, ix.SNAP_STATE])
        assert (snap[:, ix.SNAP_LAYERS] == lo).all(), (layer, snap[:, ix.SNAP_LAYERS])
