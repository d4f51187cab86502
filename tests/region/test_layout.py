"""Every on-region layout table agrees with its numpy dtype (docs/design.md invariant 9)."""
from __future__ import annotations

import numpy as np
import pytest

from tract_async.region import layout as L


@pytest.mark.parametrize("struct", L.STRUCTS, ids=lambda s: s.name)
def test_table_matches_dtype(struct: L.Struct) -> None:
    dt = struct.dtype
    assert dt.itemsize == struct.itemsize, f"{struct.name}: itemsize"
    assert list(dt.names) == [f.name for f in struct.fields], f"{struct.name}: field order"
    end = 0
    for f in struct.fields:
        fdt, off = dt.fields[f.name][:2]
        assert off == f.offset, f"{struct.name}.{f.name}: table offset {f.offset}, dtype {off}"
        assert fdt.itemsize == f.size, f"{struct.name}.{f.name}: size"
        assert np.dtype(f.type) == fdt, f"{struct.name}.{f.name}: type {f.type} vs {fdt.str}"
        assert f.offset == end, f"{struct.name}.{f.name}: gap or overlap before it"
        end = f.offset + f.size
        assert f.writer, f"{struct.name}.{f.name}: no writer documented"
    assert end == struct.itemsize, f"{struct.name}: fields do not fill the struct"
    # padded to whole cache lines, or a divisor of a line packed in line-aligned arrays
    assert struct.itemsize % L.LINE_BYTES == 0 or L.LINE_BYTES % struct.itemsize == 0


def test_signature_tracks_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    before = L.layout_signature()
    assert before == L.layout_signature()
    changed = L.Struct(name="node", fields=L.NODE.fields,
                       dtype=np.dtype([(n, "<u4" if n == "pid" else L.NODE.dtype.fields[n][0])
                                       for n in L.NODE.dtype.names]), itemsize=64)
    monkeypatch.setattr(L, "STRUCTS", [changed if s.name == "node" else s for s in L.STRUCTS])
    assert L.layout_signature() != before
