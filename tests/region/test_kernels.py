"""The kernels: instructions really emitted, and the incoherent backend really incoherent.

The sim scenarios below are the reason the sim exists: on this coherent machine the hardware
backend passes them whether or not a flush is there; the sim fails them exactly when a flush or
invalidate is missing.
"""
from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import tract_kernels as K
from tract_kernels import intrinsics as I

S_W = K.site("test.writer.flush")
S_R = K.site("test.reader.invalidate")


@pytest.fixture
def buf() -> np.ndarray:
    mm = mmap.mmap(-1, 1 << 20)
    arr = np.frombuffer(mm, dtype=np.uint8)
    yield arr


def _asm_of(py_func, *argtypes_values) -> str:
    f = njit(cache=False)(py_func)
    f(*argtypes_values)
    return "\n".join(f.inspect_asm().values())


def test_compiled_code_contains_the_instructions(buf: np.ndarray) -> None:
    addr = np.uint64(buf.ctypes.data)

    def flush_all(a):
        I.astore64(a, np.uint64(1))
        I.clflushopt_line(a)
        I.clflush_line(a)
        I.clwb_line(a)
        I.sfence()
        I.mfence()
        return I.aload64(a)

    asm = _asm_of(flush_all, addr)
    for insn in ("clflushopt", "clflush", "clwb", "sfence", "mfence"):
        assert insn in asm, f"{insn} missing from the generated code"

    def nt(a, b):
        I.nt_copy32(a, b)
        I.sfence()

    asm = _asm_of(nt, addr, addr + np.uint64(64))
    assert "movnt" in asm, "the non-temporal copy did not emit a streaming store"

    def ntw(a):
        I.ntstore64(a, np.uint64(7))
        I.sfence()

    asm = _asm_of(ntw, addr)
    assert "movnti" in asm, "the non-temporal word store did not emit movnti"

    def spin(a):
        n = 0
        while I.aload64(a) == np.uint64(12345) and n < 10:
            n += 1
        return n

    asm = _asm_of(spin, addr)
    # the load must stay inside the loop: a hoisted load would compare once and jump forever
    assert asm.count("cmp") >= 1 and "(%r" in asm


def test_hw_word_and_range_ops(buf: np.ndarray) -> None:
    m = K.make_mem(buf, "hw")
    K.store_flush(m, 64, 0xDEADBEEF, S_W)
    assert K.load_fresh(m, 64, S_R) == 0xDEADBEEF
    assert buf[64:72].view(np.uint64)[0] == 0xDEADBEEF
    with pytest.raises(IndexError):
        K.load(m, buf.size)
    with pytest.raises(IndexError):
        K.store(m, 3, 1)
    with pytest.raises(IndexError):
        K.write_bytes(m, buf.size - 4, buf.ctypes.data, 8, S_W)


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, 4096), nbytes=st.integers(0, 3000),
       backend=st.sampled_from(["hw", "sim"]), seed=st.integers(0, 2**31))
def test_payload_round_trip_any_alignment(offset: int, nbytes: int, backend: str, seed: int) -> None:
    mm = mmap.mmap(-1, 16384)
    buf = np.frombuffer(mm, dtype=np.uint8)
    m = K.make_mem(buf, backend, seed=seed)
    src = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    guard_before = buf[:offset].copy()
    K.write_bytes(m, offset, src.ctypes.data, nbytes, S_W)
    # memory itself holds the bytes (visible to anyone), and nothing around them changed
    assert np.array_equal(buf[offset:offset + nbytes], src)
    assert np.array_equal(buf[:offset], guard_before)
    dst = np.zeros(nbytes, dtype=np.uint8)
    K.read_bytes(K.make_mem(buf, backend, seed=seed + 1), offset, dst.ctypes.data, nbytes, S_R)
    assert np.array_equal(dst, src)


# ---- the incoherence scenario, run on both backends -----------------------------------------

def publish_and_read(writer: K.Mem, reader: K.Mem) -> int:
    """Reader caches the line, writer publishes a new value, reader re-reads it fresh."""
    assert K.load_fresh(reader, 128, S_R) == 0          # reader now holds the line cached
    K.store(writer, 128, 77)
    K.flush(writer, 128, S_W)
    K.full_fence(writer)
    return int(K.load_fresh(reader, 128, S_R))


def two_writers_one_line(a: K.Mem, b: K.Mem) -> tuple[int, int]:
    """Two nodes write different words of one line, each flushing: is either update lost?"""
    K.store(a, 192, 1)
    K.store(b, 200, 2)
    K.flush(a, 192, S_W)
    K.flush(b, 200, S_W)
    K.full_fence(a)
    K.full_fence(b)
    fresh = a[:K.MEM_BACKEND] + (K.BACKEND_HW,) + a[K.MEM_BACKEND + 1:]   # memory itself, no cache
    return int(K.load_fresh(fresh, 192, S_R)), int(K.load_fresh(fresh, 200, S_R))


def test_protocol_passes_on_both_backends(buf: np.ndarray, backend: str) -> None:
    w = K.make_mem(buf, backend, seed=1, evict_prob=0.0)
    r = K.make_mem(buf, backend, seed=2, evict_prob=0.0)
    assert publish_and_read(w, r) == 77


def test_sim_reader_without_invalidate_sees_stale(buf: np.ndarray) -> None:
    w = K.make_mem(buf, "sim", seed=1, evict_prob=0.0)
    r = K.make_mem(buf, "sim", seed=2, evict_prob=0.0)
    assert publish_and_read(w, K.with_skip_site(r, S_R)) == 0
    # the same scenario on the hardware backend (coherent /dev/shm) cannot show it
    buf[:] = 0
    w = K.make_mem(buf, "hw")
    r = K.make_mem(buf, "hw")
    assert publish_and_read(w, K.with_skip_site(r, S_R)) == 77


def test_sim_writer_without_flush_is_not_seen(buf: np.ndarray) -> None:
    w = K.make_mem(buf, "sim", seed=1, evict_prob=0.0)
    r = K.make_mem(buf, "sim", seed=2, evict_prob=0.0)
    assert publish_and_read(K.with_skip_site(w, S_W), r) == 0
    assert buf[128:136].view(np.uint64)[0] == 0      # memory never got it


@pytest.mark.parametrize("backend", ["hw", "sim"])
def test_store_nt_reaches_memory_without_a_flush(buf: np.ndarray, backend: str) -> None:
    """An NT word store is in memory at once; the writer's own cached copy of the line is
    written back first (its other dirty words survive) and dropped (its next load is fresh)."""
    w = K.make_mem(buf, backend, seed=1, evict_prob=0.0)
    K.store(w, 256, 11)                  # dirty word in the same line, not flushed
    K.store_nt(w, 264, 22)
    K.store_fence(w)
    words = buf[256:272].view(np.uint64)
    assert int(words[1]) == 22
    assert int(words[0]) == 11           # written back with the line, not lost
    buf[256:264].view(np.uint64)[0] = 33  # another node's write, straight to memory
    assert int(K.load(w, 256)) == 33      # the line was dropped: the load reads memory
    with pytest.raises(IndexError):
        K.store_nt(w, 3, 1)


def test_sim_two_writers_of_one_line_lose_an_update(buf: np.ndarray) -> None:
    a = K.make_mem(buf, "sim", seed=1, evict_prob=0.0)
    b = K.make_mem(buf, "sim", seed=2, evict_prob=0.0)
    assert two_writers_one_line(a, b) in ((1, 0), (0, 2))
    buf[:] = 0
    a, b = K.make_mem(buf, "hw"), K.make_mem(buf, "hw")
    assert two_writers_one_line(a, b) == (1, 2)


def test_sim_random_early_eviction_writes_back(buf: np.ndarray) -> None:
    """With eviction probability 1 a dirty line reaches memory without any flush."""
    w = K.make_mem(buf, "sim", seed=3, evict_prob=1.0, cache_lines=1)
    K.store(w, 256, 5)            # dirty in the private cache
    K.load(w, 512)                # next access evicts (probability 1) or conflicts (1 slot)
    assert buf[256:264].view(np.uint64)[0] == 5
    assert int(K.mem_state(w).ctl[3]) + int(K.mem_state(w).ctl[5]) >= 1   # counted as early eviction or conflict


def test_sim_payload_read_without_invalidate_is_stale(buf: np.ndarray) -> None:
    w = K.make_mem(buf, "sim", seed=1, evict_prob=0.0)
    r = K.make_mem(buf, "sim", seed=2, evict_prob=0.0)
    dst = np.zeros(256, dtype=np.uint8)
    K.read_bytes(r, 1024, dst.ctypes.data, 256, S_R)       # r caches the old (zero) lines
    src = np.full(256, 9, dtype=np.uint8)
    K.write_bytes(w, 1024, src.ctypes.data, 256, S_W)
    K.read_bytes(K.with_skip_site(r, S_R), 1024, dst.ctypes.data, 256, S_R)
    assert not dst.any(), "a reader that skips the invalidate must see the stale payload"
    K.read_bytes(r, 1024, dst.ctypes.data, 256, S_R)
    assert (dst == 9).all()


def test_backend_from_environment(monkeypatch: pytest.MonkeyPatch, buf: np.ndarray) -> None:
    monkeypatch.setenv(K.ENV_BACKEND, "sim")
    assert K.make_mem(buf)[K.MEM_BACKEND] == K.BACKEND_SIM
    monkeypatch.setenv(K.ENV_BACKEND, "bogus")
    with pytest.raises(ValueError, match="unknown memory backend"):
        K.make_mem(buf)


def test_sites_are_stable_and_named() -> None:
    assert K.site("test.writer.flush") == S_W
    assert K.name_of(S_W) == "test.writer.flush"
    assert "test.reader.invalidate" in K.registered("test.")


def test_two_thread_read_copies_exactly_and_stops_on_a_bad_row(buf: np.ndarray) -> None:
    """``drop_rows_ahead`` + ``read_rows_behind`` (hardware backend) copy what ``read_rows``
    copies; a row out of bounds makes the dropping half raise and the copying half give up
    instead of waiting forever."""
    import threading
    m = K.make_mem(buf, "hw")
    buf[:] = np.arange(buf.size, dtype=np.uint64).astype(np.uint8)
    rows = 40
    plan = np.array([[i * 4096 + 64, i * 3000, 3000] for i in range(rows)], dtype=np.int64)
    dst = np.zeros(rows * 3000, dtype=np.uint8)
    ctl = np.zeros(2, dtype=np.uint64)
    t = threading.Thread(target=K.drop_rows_ahead, args=(m, plan, ctl.ctypes.data, S_R))
    t.start()
    assert K.read_rows_behind(m, plan, np.uint64(dst.ctypes.data), ctl.ctypes.data, True) == 0
    t.join()
    for i in range(rows):
        assert np.array_equal(dst[i * 3000:(i + 1) * 3000], buf[i * 4096 + 64:i * 4096 + 3064])
    bad = plan.copy()
    bad[5, 0] = buf.size - 10
    ctl[:] = 0
    with pytest.raises(IndexError):
        K.drop_rows_ahead(m, bad, ctl.ctypes.data, S_R)
    assert int(ctl[1]) == 1
    good_rows = plan[:3].copy()
    ctl[0] = 0                                   # nothing dropped yet, and the other side gave up
    assert K.read_rows_behind(m, good_rows, np.uint64(dst.ctypes.data), ctl.ctypes.data,
                              False) == 1
