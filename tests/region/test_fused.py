"""The fused kernels (``stores/fused.py``): a whole small put and a whole small get in one call,
with the same steps, flushes and invalidates as the step-by-step path.

Like ``test_index_lanes.py``, two or three nodes run the kernels on one buffer under the
incoherent backend with evictions off: a line leaves a node's private cache only through a
flush or a non-temporal store, and a stale line stays until invalidated, so a removed site
shows deterministically.
"""
from __future__ import annotations

import mmap

import numpy as np
import pytest

import tract_kernels as K
from tract_async.region import index as ix
from tract_async.stores import fused

CAP, LANES, PROBE = 64, 4, 4
EOFF = 4096                                    # the entries follow a header page (lane lines)
MASK = CAP - 1
TGEO = np.full(6, -1, dtype=np.int64)          # no allocator: no slot tags
BLOCK = 4096                                   # 2 layers x K,V x 1 KiB rows
ROW = 1024
ALL_LO = 0b11
PAY = EOFF + CAP * ix.ENTRY_BYTES              # payload area: 16 slots
FENCE = PAY + 16 * BLOCK                       # a count line: its word +8 is the fencing epoch
SIZE = FENCE + 64
TMPL = np.array([[t * ROW, t * ROW, ROW] for t in range(4)], dtype=np.int64)  # one block
TMPL.setflags(write=False)   # read-only, as the engine's templates: the kernels' cached signature


@pytest.fixture
def buf() -> np.ndarray:
    mm = mmap.mmap(-1, SIZE)
    return np.frombuffer(mm, dtype=np.uint8)


def _mem(buf: np.ndarray, seed: int, skip: int = -1, lane: int = -1) -> K.Mem:
    m = K.make_mem(buf, "sim", seed=seed, evict_prob=0.0, skip_site=skip)
    if lane >= 0:
        ix.clear_lane(m, EOFF, MASK, LANES, lane)
    return m


def _params(lane: int, epoch: int = 1) -> np.ndarray:
    p = np.zeros(fused.P_FIELDS, dtype=np.int64)
    p[fused.P_LOFF] = EOFF - 4096 + 128 + 64 * lane
    p[fused.P_EOFF] = EOFF
    p[fused.P_MASK] = MASK
    p[fused.P_MAX_PROBE] = PROBE
    p[fused.P_LANES] = LANES
    p[fused.P_LANE] = lane
    p[fused.P_PRODUCER] = lane
    p[fused.P_ALL_LO] = ALL_LO
    p[fused.P_DBOFF] = -1
    p[fused.P_FENCE_OFF] = FENCE + 8
    p[fused.P_EPOCH] = epoch
    p[fused.P_POS_STEP] = BLOCK
    p[fused.P_CHUNKS_LO] = PAY
    p[fused.P_CHUNKS_END] = FENCE
    p[fused.P_BLOCK_BYTES] = BLOCK
    return p


def _keys(tags: list[int], home: int | None = None) -> np.ndarray:
    """Keys with distinct tags; with ``home``, all in that home group."""
    return np.array([[(home if home is not None else t) * LANES + (t << 8), t, t * 3, t * 7]
                     for t in tags], dtype=np.uint64)


def _ainfo(slots: list[int], lane: int) -> np.ndarray:
    return np.array([[PAY + s * BLOCK, BLOCK, lane, 1] for s in slots], dtype=np.uint64)


def _src(n: int, fill: int) -> np.ndarray:
    """n blocks laid out as a tensor: block j's rows at j*BLOCK (pos step BLOCK, template rows
    within one block), every byte ``fill + j``."""
    return np.concatenate([np.full(BLOCK, fill + j, dtype=np.uint8) for j in range(n)])


def _put(m: K.Mem, lane: int, keys: np.ndarray, slots: list[int], src: np.ndarray,
         epoch: int = 1) -> tuple[int, np.ndarray]:
    res = np.zeros((keys.shape[0], 3), dtype=np.int64)
    st = fused.put_blocks(m, _params(lane, epoch), TGEO, keys, _ainfo(slots, lane), TMPL,
                          np.uint64(src.ctypes.data), 1, 0, res)
    return int(st), res


def _get(m: K.Mem, keys: np.ndarray, validate: bool = True) -> tuple[int, np.ndarray, np.ndarray]:
    n = keys.shape[0]
    out = np.zeros(n * BLOCK, dtype=np.uint8)
    snap = np.zeros((n, 8), dtype=np.int64)
    ok = np.zeros(n, dtype=np.bool_)
    st = fused.get_blocks(m, _params(0), TGEO, keys, TMPL, np.uint64(out.ctypes.data), validate,
                          snap, ok)
    return int(st), out, snap


def test_a_put_is_read_whole_by_another_node(buf: np.ndarray) -> None:
    a, b = _mem(buf, 1, lane=1), _mem(buf, 2, lane=2)
    keys = _keys([1, 2, 3])
    src = _src(3, 10)
    st, res = _put(a, 1, keys, [0, 1, 2], src)
    assert st == 0 and (res[:, 0] >= 0).all() and (res[:, 0] % LANES == 1).all()
    got, out, snap = _get(b, keys)
    assert got == 0 and (snap[:, 2] == ix.READY).all()
    assert np.array_equal(out, src)
    # the lane's publishes counter counts the blocks (as reserve_batch_counted does)
    assert int(K.load_fresh(b, EOFF - 4096 + 128 + 64 + ix.LN_PUBLISHES, ix.S_IX_READ)) == 3


def test_a_key_already_live_is_skipped_and_its_slot_untouched(buf: np.ndarray) -> None:
    a, b = _mem(buf, 1, lane=1), _mem(buf, 2, lane=2)
    first = _src(1, 50)
    _put(a, 1, _keys([7]), [0], first)
    st, res = _put(b, 2, _keys([7, 8]), [5, 6], _src(2, 90))
    assert st == 0 and res[0, 0] <= -2 and res[1, 0] >= 0
    got, out, _ = _get(_mem(buf, 3), _keys([7, 8]))
    assert got == 0
    assert (out[:BLOCK] == 50).all() and (out[BLOCK:] == 91).all()
    assert (buf[PAY + 5 * BLOCK:PAY + 6 * BLOCK] == 0).all(), "a skipped key's slot was written"


def test_a_fenced_node_writes_nothing(buf: np.ndarray) -> None:
    a = _mem(buf, 1, lane=1)
    K.store_flush(a, FENCE + 8, 4, ix.S_IX_HDR)        # judged dead at epoch 4
    before = buf.copy()
    st, _ = _put(a, 1, _keys([1]), [0], _src(1, 3), epoch=4)
    assert st == fused.FENCED
    K.flush_range(a, 0, SIZE, -2)
    assert np.array_equal(buf, before)
    assert _put(a, 1, _keys([1]), [0], _src(1, 3), epoch=5)[0] == 0   # a later incarnation


def test_a_full_window_stops_before_any_copy(buf: np.ndarray) -> None:
    """With PROBE groups, lane 1 has PROBE entries in one home's window: the next key of that
    home finds none; the others stay RESERVED (the caller takes them back) and nothing is
    copied or published."""
    a, r = _mem(buf, 1, lane=1), _mem(buf, 3)
    full = _keys(list(range(1, PROBE + 1)), home=2)
    assert _put(a, 1, full, list(range(PROBE)), _src(PROBE, 1))[0] == 0
    keys = _keys([40, 41], home=None)
    keys = np.vstack([keys[:1], _keys([99], home=2)])
    st, res = _put(a, 1, keys, [8, 9], _src(2, 100))
    assert st == fused.WINDOW_FULL and res[0, 0] >= 0 and res[1, 0] == -1
    got, _, snap = _get(r, keys[:1])
    assert got == fused.NOT_READY and snap[0, 2] == ix.RESERVED
    assert (buf[PAY + 8 * BLOCK:PAY + 9 * BLOCK] == 0).all(), "copied before the window check"


def test_a_get_of_an_absent_or_unfinished_block_copies_nothing(buf: np.ndarray) -> None:
    a, r = _mem(buf, 1, lane=1), _mem(buf, 3)
    _put(a, 1, _keys([1]), [0], _src(1, 5))
    got, out, snap = _get(r, _keys([1, 2]))
    assert got == fused.NOT_READY and snap[1, 0] == -1 and not out.any()


def test_payload_bounds_outside_the_chunks_are_refused(buf: np.ndarray) -> None:
    a, r = _mem(buf, 1, lane=1), _mem(buf, 3)
    res = np.zeros((1, 3), dtype=np.int64)
    bad = np.array([[FENCE, BLOCK, 1, 1]], dtype=np.uint64)     # past the payload area
    src = _src(1, 5)
    assert fused.put_blocks(a, _params(1), TGEO, _keys([3]), bad, TMPL[:0],
                            np.uint64(src.ctypes.data), 1, 0, res) == 0
    got, out, _ = _get(r, _keys([3]))
    assert got == fused.BAD_BOUNDS and not out.any()


def test_without_the_payload_invalidate_a_reader_returns_stale_bytes(buf: np.ndarray) -> None:
    """The reader reads block X (its lines now cached), X is evicted and its slot reused for Y
    by the producer; the reader's next get of Y must not copy X's cached lines. Without the
    payload invalidate it does -- and revalidation cannot see it (entry and version are Y's)."""
    for skip, fresh in ((-1, True), (ix.S_IX_PAYLOAD_READ, False)):
        buf[:] = 0
        a, r = _mem(buf, 1, lane=1), _mem(buf, 3, skip)
        x, y = _keys([1]), _keys([2])
        st, res = _put(a, 1, x, [4], _src(1, 0x11))
        got, out, _ = _get(r, x)
        assert got == 0 and (out == 0x11).all()
        ix.evict_batch(a, EOFF, TGEO, MASK, LANES, 1, res[:, 0].copy(), ix.TOMBSTONE,
                       np.zeros((1, 5), dtype=np.int64))
        _put(a, 1, y, [4], _src(1, 0x22))
        got, out, _ = _get(r, y)
        assert got == 0
        assert bool((out == 0x22).all()) is fresh, skip


def test_revalidation_off_is_honoured(buf: np.ndarray) -> None:
    a, r = _mem(buf, 1, lane=1), _mem(buf, 3)
    _put(a, 1, _keys([1]), [0], _src(1, 5))
    assert _get(r, _keys([1]), validate=False)[0] == 0
