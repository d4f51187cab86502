"""The layer streams' registry and checks without a GPU (``cuda/layerstream.py``): which stream
a later layer finds, and what makes a stream decline. The streams' steps on a device are
``tests/cuda/test_layer_streams_gpu.py``."""
from __future__ import annotations

import numpy as np
import pytest

import tract_async as tract
from tract_async.cuda import direct, layerstream as ls
from tract_async.stores.fillbook import FillBatch

torch = pytest.importorskip("torch")

LAY = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16)


def keys_of(n: int, salt: int) -> list[bytes]:
    return [bytes([salt, i]) * 8 for i in range(n)]


def put_stream(keys: list[bytes]) -> ls.PutStream:
    n = len(keys)
    poffs = np.arange(n, dtype=np.int64) * LAY.block_bytes + (1 << 20)
    tmpl = direct.template(LAY, poffs, False, 0)
    assert tmpl is not None
    t = torch.empty(LAY.kv_shape(n, 0), dtype=LAY.dtype)
    batch = FillBatch(keys, np.arange(n), np.ones(n, dtype=np.int64), poffs, np.zeros(n),
                      np.zeros((n, 16), dtype=np.uint64))
    return ls.PutStream(keys, t, None, tmpl, LAY.num_layers, batch)


def test_found_by_identity_or_content_and_never_by_another_list() -> None:
    s = ls.Streams()
    assert s.on
    k = keys_of(3, 1)
    st = put_stream(k)
    s.add_put(st)
    assert s.find_put(k) is st
    assert s.find_put(list(k)) is st                    # a new list of the same keys
    assert s.find_put(k[:2]) is None                    # fewer keys
    assert s.find_put(list(reversed(k))) is None        # another order
    assert s.find_put(tuple(k)) is None                 # not a list: the whole path checks it
    assert s.find_get(k) is None                        # the other side has its own


def test_newest_first_one_per_key_list_and_at_most_keep() -> None:
    s = ls.Streams()
    k = keys_of(2, 2)
    a, b = put_stream(k), put_stream(list(k))
    s.add_put(a)
    s.add_put(b)                                        # the same keys: replaces a
    assert s.puts == [b]
    many = [put_stream(keys_of(2, 10 + i)) for i in range(ls.KEEP + 3)]
    for st in many:
        s.add_put(st)
    assert len(s.puts) == ls.KEEP and s.puts[0] is many[-1]
    assert s.find_put(k) is None                        # pushed out
    s.drop(many[-1])
    assert s.find_put(many[-1].keys) is None and len(s.puts) == ls.KEEP - 1


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ls.STREAMS_ENV, "0")
    s = ls.Streams()
    assert not s.on
    s.add_put(put_stream(keys_of(2, 3)))
    assert s.puts == [] and s.find_put(keys_of(2, 3)) is None


def test_fits_only_the_first_layers_tensor_form() -> None:
    k = keys_of(3, 4)
    st = put_stream(k)
    good = torch.empty(LAY.kv_shape(3, 0), dtype=LAY.dtype)
    assert st.fits(1, good) and st.fits(LAY.num_layers - 1, good)
    assert not st.fits(LAY.num_layers, good) and not st.fits(-1, good)
    assert not st.fits(np.int64(1), good)               # the whole path says what is wrong
    assert not st.fits(True, good)
    assert not st.fits(1, torch.empty(LAY.kv_shape(2, 0), dtype=LAY.dtype))
    assert not st.fits(1, torch.empty(LAY.kv_shape(3, 0), dtype=torch.float16))
    assert not st.fits(1, good.transpose(1, 2).contiguous().transpose(1, 2))
    assert st.nbytes == 3 * LAY.layer_bytes


def get_stream(rows: np.ndarray, first: int = 0, layers: int = 8) -> ls.GetStream:
    n = rows.shape[0]
    poffs = rows[:, 3].copy()
    tmpl = direct.template(LAY, poffs, False, 0)
    assert tmpl is not None
    t = torch.empty(LAY.kv_shape(n, 0), dtype=LAY.dtype)
    return ls.GetStream(keys_of(n, 7), t, None, tmpl, layers, poffs, rows,
                        np.zeros((n, 4), dtype=np.uint64), first)


def snap_rows(n: int, state: int, lo: int) -> np.ndarray:
    """Snapshot rows (``PrefixIndex.snapshot`` columns) of ``n`` evenly spaced blocks."""
    rows = np.zeros((n, 8), dtype=np.int64)
    rows[:, 0] = np.arange(n)
    rows[:, 1] = 5
    rows[:, 2] = state
    rows[:, 3] = np.arange(n, dtype=np.int64) * LAY.block_bytes + (1 << 20)
    rows[:, 4] = LAY.block_bytes
    rows[:, 5] = lo
    return rows


def test_a_stream_knows_only_layers_a_validated_read_of_its_rows_saw_in_every_block() -> None:
    """cuda/layerstream.py, "Seen layers": nothing is known before a validated read; then the
    AND of the blocks' bits (READY: every layer); a read validated against rows the stream no
    longer reads by teaches nothing; new rows forget."""
    from tract_async.region.index import READY, RESERVED
    rows = snap_rows(3, RESERVED, 0b0011)
    s = get_stream(rows)
    assert not s.knows(1)                       # no validated read yet: look
    part = rows.copy()
    part[:, 5] = 0b0111
    part[1, 5] = 0b1111                         # one block further on: the AND counts
    s.validated(s.rows, part)
    assert s.knows(2)
    assert not s.knows(3)
    later = rows.copy()
    later[:, 5] = 0b11111111
    s.validated(rows.copy(), later)             # prepared by other rows: not learned
    assert not s.knows(4)
    s.validated(s.rows, later)
    assert s.knows(5) and s.knows(6)
    s.new_rows(rows.copy())                     # (a wait found newer entries): forgotten
    assert not s.knows(7)
    ready = snap_rows(3, READY, 0)              # READY rows hold every layer, bits or not
    s2 = get_stream(ready)
    s2.validated(s2.rows, ready)
    assert all(s2.knows(i) for i in range(1, 8))


def test_a_layer_asked_again_starts_a_new_requests_reads() -> None:
    """A layer read a second time by the same stream (the same keys' next request) forgets what
    was learned and looks: blocks consumed or evicted and put again are then waited for."""
    from tract_async.region.index import READY
    ready = snap_rows(2, READY, 0)
    s = get_stream(ready, first=0)
    s.validated(s.rows, ready)
    assert [s.knows(i) for i in range(1, 8)] == [True] * 7
    assert not s.knows(0)                       # layer 0 again: a new request; look
    s.validated(s.rows, ready)
    assert s.knows(1)


def test_layers_in_all_covers_both_words() -> None:
    from tract_async.region.index import RESERVED
    rows = snap_rows(2, RESERVED, -1)           # all 64 low bits (int64 -1)
    rows[:, 6] = 0b1
    rows[1, 6] = 0b11
    assert ls.layers_in_all(rows, 66) == (1 << 65) - 1
    assert ls.layers_in_all(rows[:0], 5) == 0b11111
