"""Namespace records (``region/namespaces.py``): written once under the lock, read lock-free.

Two Region objects over one file with the sim backend are two hosts with private caches (no
random early write-backs: ``sim_evict_prob=0``). The reader caches the record's lines first
(EMPTY), the writer records, the reader looks again. With every site the reader sees the
whole record; without the writer's record flush it sees READY with no layout, without the
state flush no record, and without its own invalidate no record either (its stale copy).
"""
from __future__ import annotations

import pytest

import tract_kernels as K
from tract_async import errors as E
from tract_async.region import Region, SectionSpec
from tract_async.region import layout as L
from tract_async.region import namespaces as ns

LAY = ns.NamespaceLayout(name="llama3-8b", rank=0, world_size=1, num_layers=32, block_tokens=16,
                         kv_heads=8, head_dim=128, dtype="bfloat16", block_bytes=2 << 20)


def _pair(path: str, pages: int = 8) -> tuple[Region, Region]:
    spec = SectionSpec(name=ns.SECTION, nbytes=pages * L.PAGE_BYTES)
    w = Region.create(path, 1 << 20, sections=[spec], backend="sim", sim_seed=1,
                      sim_evict_prob=0.0)
    r = Region.attach(path, backend="sim", sim_seed=2, sim_evict_prob=0.0)
    return w, r


def _race(path: str, *, skip_writer: str | None = None, skip_reader: str | None = None
          ) -> ns.NamespaceRecord | None:
    w, r = _pair(path)
    try:
        sites = K.registered("namespaces.")
        if skip_writer:
            w.mem = K.with_skip_site(w.mem, sites[skip_writer])
        if skip_reader:
            r.mem = K.with_skip_site(r.mem, sites[skip_reader])
        reader = ns.NamespaceTable.of(r)
        assert reader.find(LAY.ns_id) is None          # caches the record's lines, EMPTY
        ns.NamespaceTable.of(w).record(LAY, node_id=3, holding_lock=True)
        return reader.find(LAY.ns_id)
    finally:
        r.close()
        w.close()


def test_the_sites_are_named() -> None:
    assert set(K.registered("namespaces.")) == {"namespaces.record.flush",
                                                "namespaces.state.flush",
                                                "namespaces.read.invalidate"}


def test_another_node_reads_the_whole_record_with_every_site(region_path: str) -> None:
    got = _race(region_path)
    assert got is not None and got.layout == LAY and got.tag == 1 and got.recorded_by == 3


def test_without_the_record_flush_the_reader_sees_ready_without_a_layout(region_path: str
                                                                          ) -> None:
    got = _race(region_path, skip_writer="namespaces.record.flush")
    assert got is not None and got.layout.name == LAY.name      # line 0 went with its state
    assert got.layout.geometry() != LAY.geometry() and got.layout.num_layers == 0


def test_without_the_state_flush_the_reader_sees_no_record(region_path: str) -> None:
    assert _race(region_path, skip_writer="namespaces.state.flush") is None


def test_without_the_readers_invalidate_it_keeps_its_stale_empty_copy(region_path: str) -> None:
    assert _race(region_path, skip_reader="namespaces.read.invalidate") is None


def test_records_fill_in_order_once_each_and_a_full_table_refuses(region_path: str) -> None:
    w, r = _pair(region_path, pages=1)          # one page: 32 records
    try:
        t = ns.NamespaceTable.of(w)
        assert t.slots == L.PAGE_BYTES // ns.RECORD_BYTES == 32
        with pytest.raises(ValueError, match="global lock"):
            t.record(LAY, node_id=0, holding_lock=False)
        first = t.record(LAY, node_id=0, holding_lock=True)
        again = t.record(ns.NamespaceLayout(**{**LAY.__dict__, "num_layers": 2}), node_id=1,
                         holding_lock=True)
        assert again == first      # one record per namespace: the caller compares layouts
        for rank in range(1, 32):
            t.record(ns.NamespaceLayout(**{**LAY.__dict__, "rank": rank, "world_size": 32}),
                     node_id=0, holding_lock=True)
        assert [x.tag for x in ns.NamespaceTable.of(r).records()] == list(range(1, 33))
        with pytest.raises(E.NamespaceTableFull, match="all 32 namespace records"):
            t.record(ns.NamespaceLayout(**{**LAY.__dict__, "name": "another"}), node_id=0,
                     holding_lock=True)
        assert isinstance(E.NamespaceTableFull("x"), E.RegionFull)
    finally:
        r.close()
        w.close()


def test_a_long_name_is_cut_for_messages_but_found_by_its_identity(region_path: str) -> None:
    w, r = _pair(region_path)
    try:
        long = ns.NamespaceLayout(**{**LAY.__dict__, "name": "é" * 40})   # 80 UTF-8 bytes
        rec = ns.NamespaceTable.of(w).record(long, node_id=0, holding_lock=True)
        got = ns.NamespaceTable.of(r).find(long.ns_id)
        assert got is not None and got.slot_index == rec.slot_index
        assert got.layout.name == "é" * 16 and got.layout.geometry() == long.geometry()
        assert ns.NamespaceTable.of(r).find(LAY.ns_id) is None
    finally:
        r.close()
        w.close()


def test_a_tag_that_names_no_record_is_damage(region_path: str) -> None:
    w, r = _pair(region_path)
    try:
        with pytest.raises(E.RegionCorrupt, match="namespace record 4"):
            ns.NamespaceTable.of(r).by_tag(5)
        with pytest.raises(E.RegionCorrupt):
            ns.NamespaceTable.of(r).by_tag(0)
    finally:
        r.close()
        w.close()


def test_tags_live_in_bits_32_to_47_of_the_entry_flags() -> None:
    assert ns.ns_flags(7) == 7 << 32 and ns.ns_tag_of(ns.ns_flags(7) | 1) == 7
    assert ns.ns_tag_of(1) == 0                   # FLAG_TRANSFER alone: no tag
    with pytest.raises(ValueError):
        ns.ns_flags(1 << 16)
    assert L.NAMESPACE_SLOTS <= L.INDEX_FLAG_NS_MASK
    assert ns.section_bytes() == 32 << 10
