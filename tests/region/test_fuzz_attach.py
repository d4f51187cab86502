"""Fuzzed attach: a damaged region is either read correctly or refused with a typed error.

Another node's bug, a stray write or a foreign program can leave any bytes in a shared region,
and every node maps it. So attach and the lock-free read paths (node table, root directory,
prefix index lookup, snapshot, scan, fsck, an engine's get) must treat each word of the region
as untrusted input: the only acceptable outcomes are a working result or a ``TractError``.
Anything else is a bug: another exception type (an IndexError from a jitted kernel with
NUMBA_BOUNDSCHECK=1, which without the bounds check is a wild read or a segfault), a hang, a
huge allocation sized by a field, or a write (attach and the readers write nothing, so the file
must be byte-identical afterwards).

A base region is made once per module by a real Engine (sections, an index with live entries,
blocks in the allocator); every example writes its bytes back to a file, applies one mutation
(a field of the header, optionally with its checksum recomputed so that the mutation reaches
the checks behind it; a node table record; a root-directory (section table) record; the index
header; an index entry; or raw byte flips) and attaches. The number of examples run is printed
at the end of the module (the README's "fuzz cases" figure).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tract_async as tract
from tract_async import errors as E
from tract_async.tools import fsck
from tract_async.keys import keys_to_words
from tract_async.region import Region
from tract_async.region import layout as L
from tract_async.region.index import PrefixIndex
from tests.support.engine_util import block_matches, cfg, kv_for_keys

pytestmark = pytest.mark.fsck_dirty    # every example leaves a damaged region, on purpose

REGION_BYTES = 8 << 20
MAX_NODES = 4
N_BLOCKS = 6
EXAMPLE_LIMIT_S = 20.0
"""An example slower than this is a hang (the region is 8 MiB: attach and a scan take ms)."""

FUZZ = settings(max_examples=150, deadline=None, derandomize=False, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

COUNTS: dict[str, int] = {}
"""Examples run per property, printed at module teardown."""


class Hang(Exception):
    """Raised by the alarm when one example runs past EXAMPLE_LIMIT_S."""


@dataclass(frozen=True)
class Base:
    """The pristine region's bytes and what is in it."""
    raw: bytes
    keys: list[bytes]
    header: dict[str, int]
    sections: dict[str, tuple[int, int, int]]     # name -> (slot, offset, nbytes)
    index_offset: int
    entries_offset: int
    capacity: int
    live_slots: list[int]

    def __repr__(self) -> str:          # the 8 MiB of bytes stay out of failure reports
        return f"Base({len(self.raw)} bytes, {len(self.keys)} keys, live slots {self.live_slots})"


def _write(path: str, data: bytes | bytearray) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def base(request: pytest.FixtureRequest) -> Iterator[Base]:
    path = f"/dev/shm/tract-test-{os.getpid()}-fuzzbase"

    async def build() -> tuple[list[bytes], bytes]:
        eng = await tract.Engine.open(cfg(path, 0, create=True, region_bytes=REGION_BYTES,
                                          max_nodes=MAX_NODES, overwrite=True))
        try:
            keys = eng.block_keys(range(16 * N_BLOCKS))
            assert await eng.put_kv(keys, kv_for_keys(keys)) == N_BLOCKS
            # copied while the node is live: a leaving node takes its chunks and their index
            # entries with it, and the fuzz wants live entries to damage
            with open(path, "rb") as f:
                return keys, f.read()
        finally:
            await eng.close()

    try:
        keys, raw = asyncio.run(build())
        _write(path, raw)
        with Region.attach(path, backend="hw", wait_init_s=0) as r:
            secs = {e.name: (e.slot_index, e.offset_bytes, e.nbytes) for e in r.root.entries()}
            ix = PrefixIndex(r)
            table = ix.scan()
            live = [int(s) for s in np.flatnonzero(table[:, 0] == 2)]
            b = Base(raw=raw, keys=keys, header=r.header, sections=secs,
                     index_offset=ix.geo.header_offset, entries_offset=ix.geo.entries_offset,
                     capacity=ix.geo.capacity, live_slots=live)
        assert len(b.live_slots) == N_BLOCKS
    finally:
        if os.path.exists(path):
            os.unlink(path)
    yield b
    total = sum(COUNTS.values())
    line = (f"fuzz cases: {total} mutated regions attached "
            f"({', '.join(f'{k} {v}' for k, v in sorted(COUNTS.items()))})")
    cap = request.config.pluginmanager.get_plugin("capturemanager")
    if cap is not None:     # past the capture, so that the figure shows without -s
        with cap.global_and_fixture_disabled():
            print("\n" + line)
    else:
        print(line)


# ---- mutations ------------------------------------------------------------------------------

def _values(size: int) -> st.SearchStrategy[int]:
    """u64 values: uniform, small, and the edges a size or offset check must get right."""
    edges = [0, 1, 2, 3, 7, 63, 64, 65, 4095, 4096, 4097, size - 1, size, size + 1, 2 * size,
             1 << 31, 1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 64, (1 << 64) - 1]
    return st.one_of(st.sampled_from(edges), st.integers(0, 4 * size),
                     st.integers(0, (1 << 64) - 1))


def _set_u64(buf: bytearray, off: int, value: int, width: int = 8) -> None:
    buf[off:off + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")


def _rechecksum(buf: bytearray) -> None:
    crc = zlib.crc32(bytes(buf[:L.HEADER_CHECKSUM_SPAN]))
    _set_u64(buf, L.HEADER_CHECKSUM_SPAN, crc)


_HEADER_FIELDS = [(f.name, f.offset, f.size) for f in L.HEADER.fields]
_NODE_FIELDS = [(f.name, f.offset, f.size) for f in L.NODE.fields]
_ROOT_FIELDS = [(f.name, f.offset, f.size) for f in L.ROOT_ENTRY.fields if f.name != "name"]
_IXH_FIELDS = [(f.name, f.offset, f.size) for f in L.INDEX_HEADER.fields if f.size == 8]
_IXE_FIELDS = [(f.name, f.offset, f.size) for f in L.INDEX_ENTRY.fields]


@st.composite
def header_mutation(draw: st.DrawFn) -> tuple[str, int, int, bool]:
    name, off, size = draw(st.sampled_from(_HEADER_FIELDS))
    return name, off, size, draw(st.booleans())


# ---- the probe --------------------------------------------------------------------------------

def _alarm(signum: int, frame: object) -> None:
    raise Hang(f"example ran past {EXAMPLE_LIMIT_S} s")


def _unchanged(path: str, data: bytes | bytearray) -> bool:
    """The file holds exactly ``data`` (a byte compare: a digest of both sides cost 13 ms of
    each ~65 ms example)."""
    with open(path, "rb") as f:
        return f.read() == data


def _readers(region: Region, base: Base) -> None:
    """Every lock-free read an attacher does, over the whole (possibly damaged) region."""
    region.nodes.all()
    region.root.entries()
    ix = PrefixIndex(region)
    words = keys_to_words(base.keys)
    ix.lookup(words)
    ix.snapshot(words)
    ix.scan()
    fsck.check(region)


def _probe(path: str, data: bytes | bytearray, base: Base, what: str) -> None:
    """Write ``data`` to ``path``, attach and read; only a TractError may come out, the file
    must be unchanged and the example must end within EXAMPLE_LIMIT_S."""
    _write(path, data)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, EXAMPLE_LIMIT_S)
    t0 = time.monotonic()
    try:
        with Region.attach(path, backend="hw", wait_init_s=0) as region:
            _readers(region, base)
    except E.TractError:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < EXAMPLE_LIMIT_S
    assert os.path.getsize(path) == len(data), "attach changed the file's size"
    assert _unchanged(path, data), "attach or a lock-free reader wrote to the region"
    COUNTS[what] = COUNTS.get(what, 0) + 1


# ---- properties ---------------------------------------------------------------------------

def test_pristine_base_attaches(region_path: str, base: Base) -> None:
    """The unmutated copy attaches and reads every block (the fuzz starts from a good region)."""
    _write(region_path, base.raw)
    with Region.attach(region_path, backend="hw", wait_init_s=0) as region:
        assert PrefixIndex(region).lookup(keys_to_words(base.keys)) == N_BLOCKS
        fsck.check(region)    # findings expected: the copy's node 0 is no longer beating


@FUZZ
@given(data=st.data())
def test_fuzz_header_fields(region_path: str, base: Base, data: st.DataObject) -> None:
    name, off, size, fix = data.draw(header_mutation(), label="field")
    value = data.draw(_values(REGION_BYTES), label="value")
    buf = bytearray(base.raw)
    _set_u64(buf, off, value, size)
    if fix and name != "header_checksum":
        _rechecksum(buf)      # get past the checksum to the checks behind it
    _probe(region_path, buf, base, "header")


@FUZZ
@given(data=st.data())
def test_fuzz_node_table(region_path: str, base: Base, data: st.DataObject) -> None:
    node = data.draw(st.integers(0, MAX_NODES - 1), label="node")
    name, off, size = data.draw(st.sampled_from(_NODE_FIELDS), label="field")
    value = data.draw(st.one_of(st.integers(0, 4), _values(REGION_BYTES)), label="value")
    buf = bytearray(base.raw)
    _set_u64(buf, base.header["node_table_offset"] + node * L.NODE.itemsize + off, value, size)
    _probe(region_path, buf, base, "node table")


@FUZZ
@given(data=st.data())
def test_fuzz_section_table(region_path: str, base: Base, data: st.DataObject) -> None:
    """Root-directory records: where every section (lock, allocator, index) lies."""
    sec = data.draw(st.sampled_from(sorted(base.sections)), label="section")
    slot = base.sections[sec][0]
    rec = base.header["rootdir_offset"] + slot * L.ROOT_ENTRY.itemsize
    buf = bytearray(base.raw)
    if data.draw(st.booleans(), label="rename"):
        name = data.draw(st.binary(min_size=L.ROOT_NAME_BYTES, max_size=L.ROOT_NAME_BYTES))
        buf[rec:rec + L.ROOT_NAME_BYTES] = name
    else:
        field, off, size = data.draw(st.sampled_from(_ROOT_FIELDS), label="field")
        value = data.draw(_values(REGION_BYTES), label="value")
        _set_u64(buf, rec + off, value, size)
    _probe(region_path, buf, base, "section table")


@FUZZ
@given(data=st.data())
def test_fuzz_index_header(region_path: str, base: Base, data: st.DataObject) -> None:
    name, off, size = data.draw(st.sampled_from(_IXH_FIELDS), label="field")
    value = data.draw(_values(REGION_BYTES), label="value")
    buf = bytearray(base.raw)
    _set_u64(buf, base.index_offset + off, value, size)
    _probe(region_path, buf, base, "index header")


@FUZZ
@given(data=st.data())
def test_fuzz_index_entries(region_path: str, base: Base, data: st.DataObject) -> None:
    """Live entries mostly (they are what a get follows), any entry sometimes; 1-3 fields."""
    buf = bytearray(base.raw)
    for _ in range(data.draw(st.integers(1, 3), label="fields")):
        slot = data.draw(st.one_of(st.sampled_from(base.live_slots),
                                   st.integers(0, base.capacity - 1)), label="slot")
        name, off, size = data.draw(st.sampled_from(_IXE_FIELDS), label="field")
        value = data.draw(st.one_of(st.integers(0, 4), _values(REGION_BYTES)), label="value")
        _set_u64(buf, base.entries_offset + slot * L.INDEX_ENTRY.itemsize + off, value, size)
    _probe(region_path, buf, base, "index entry")


@FUZZ
@given(data=st.data())
def test_fuzz_byte_flips(region_path: str, base: Base, data: st.DataObject) -> None:
    """1-8 random bytes anywhere in the metadata (header page up to the end of the index)."""
    end = base.entries_offset + base.capacity * L.INDEX_ENTRY.itemsize
    buf = bytearray(base.raw)
    for _ in range(data.draw(st.integers(1, 8), label="flips")):
        at = data.draw(st.integers(0, end - 1), label="at")
        buf[at] = data.draw(st.integers(0, 255), label="byte")
    _probe(region_path, buf, base, "byte flips")


# ---- an engine over a damaged index -----------------------------------------------------------

ENGINE_FUZZ = settings(FUZZ, max_examples=25)


@ENGINE_FUZZ
@given(data=st.data())
def test_fuzz_index_entries_engine_get(region_path: str, base: Base, data: st.DataObject) -> None:
    """An Engine attached (create=False) to a region with damaged entries: lookup and get_kv
    either raise a TractError or return exactly the stored bytes of every block they return --
    a damaged entry is a miss, never another block's bytes."""
    buf = bytearray(base.raw)
    for _ in range(data.draw(st.integers(1, 2), label="fields")):
        slot = data.draw(st.sampled_from(base.live_slots), label="slot")
        name, off, size = data.draw(st.sampled_from(_IXE_FIELDS), label="field")
        value = data.draw(st.one_of(st.integers(0, 4), _values(REGION_BYTES)), label="value")
        _set_u64(buf, base.entries_offset + slot * L.INDEX_ENTRY.itemsize + off, value, size)
    _write(region_path, bytes(buf))

    async def run() -> None:
        eng = await tract.Engine.open(cfg(region_path, 1, region_bytes=REGION_BYTES,
                                          max_nodes=MAX_NODES, attach_timeout_s=0.0))
        try:
            n = eng.lookup(base.keys)
            assert 0 <= n <= N_BLOCKS
            for i, k in enumerate(base.keys):
                try:
                    got = await eng.get_kv([k])
                except E.TractError:
                    continue
                assert block_matches([k], got) == [True], f"block {i} came back with wrong bytes"
        finally:
            await eng.close()

    t0 = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(run(), EXAMPLE_LIMIT_S))
    except E.TractError:
        pass
    assert time.monotonic() - t0 < EXAMPLE_LIMIT_S + 5
    assert os.path.getsize(region_path) == len(buf), "the engine changed the file's size"
    COUNTS["engine get"] = COUNTS.get("engine get", 0) + 1


@pytest.mark.parametrize("layer", [None, 0])
def test_a_payload_offset_near_2_63_is_a_miss(region_path: str, base: Base,
                                              layer: int | None) -> None:
    """Found by the fuzz above (payload_offset = 2**63 - 1): the fused get's bounds check
    computed ``offset + nbytes > end`` in int64, the sum wrapped negative, the check passed and
    the copy went outside the region (IndexError, not a miss). ``layer=None`` takes the fused
    get, ``layer=0`` the step-by-step one."""
    buf = bytearray(base.raw)
    slot = base.live_slots[0]
    off = next(o for name, o, _ in _IXE_FIELDS if name == "payload_offset")
    _set_u64(buf, base.entries_offset + slot * L.INDEX_ENTRY.itemsize + off, (1 << 63) - 1)
    _write(region_path, bytes(buf))

    async def run() -> int:
        eng = await tract.Engine.open(cfg(region_path, 1, region_bytes=REGION_BYTES,
                                          max_nodes=MAX_NODES, attach_timeout_s=0.0))
        misses = 0
        try:
            for k in base.keys:
                try:
                    got = await eng.get_kv([k], layer=layer)
                except E.TractError:
                    misses += 1
                    continue
                assert block_matches([k], got, layer=layer) == [True]
        finally:
            await eng.close()
        return misses

    assert asyncio.run(asyncio.wait_for(run(), EXAMPLE_LIMIT_S)) >= 1
