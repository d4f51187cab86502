"""``stores/snapcheck.rows_fine``: the one-pass check of a read's snapshot says True exactly when
every row passes the step-by-step checks of ``prepare_read`` (present, available, this layout's
namespace tag, payload bounds), against a reference written row by row in Python."""
from __future__ import annotations

import numpy as np
import pytest

from tract_async.region import index as ix
from tract_async.region.layout import INDEX_FLAG_NS_MASK, INDEX_FLAG_NS_SHIFT
from tract_async.stores.snapcheck import rows_fine

BB = 1 << 21
LO, HI = 1 << 24, 1 << 30
TAG = 3


def reference(snap: np.ndarray, layer: int, tag: int, mask: int) -> bool:
    for r in snap.tolist():
        if r[0] < 0:
            return False
        if r[2] != ix.READY and (layer < 0 or not (r[5 + layer // 64] >> (layer % 64)) & 1):
            return False
        if ((r[7] >> INDEX_FLAG_NS_SHIFT) & mask) != tag:
            return False
        if r[4] != BB or r[3] < LO or r[3] > HI - BB:
            return False
    return True


def fine_rows(n: int, rng: np.random.Generator) -> np.ndarray:
    snap = np.zeros((n, 8), dtype=np.int64)
    snap[:, 0] = rng.choice(1 << 16, n, replace=False)
    snap[:, 1] = rng.integers(1, 1 << 20, n)
    snap[:, 2] = ix.READY
    snap[:, 3] = LO + rng.choice((HI - LO) // BB, n, replace=False) * BB
    snap[:, 4] = BB
    snap[:, 7] = TAG << INDEX_FLAG_NS_SHIFT
    return snap


FAULTS = ["absent", "reserved-without-layer", "reserved-with-layer", "foreign-tag", "nbytes",
          "below", "past-end", "bit63-layer"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("layer", [-1, 0, 5, 63, 64, 100])
def test_rows_fine_agrees_with_the_row_by_row_checks(fault: str, layer: int) -> None:
    rng = np.random.default_rng(hash((fault, layer)) & 0xFFFF)
    for n in (9, 33, 300):
        snap = fine_rows(n, rng)
        assert rows_fine(snap, layer, BB, LO, HI, TAG, INDEX_FLAG_NS_SHIFT, INDEX_FLAG_NS_MASK)
        i = int(rng.integers(n))
        if fault == "absent":
            snap[i, 0] = -1
        elif fault.startswith("reserved"):
            snap[i, 2] = ix.RESERVED
            if fault == "reserved-with-layer" and layer >= 0:
                snap[i, 5 + layer // 64] |= np.int64(1) << np.int64(layer % 64) if layer % 64 != 63 \
                    else np.int64(-(1 << 63))
        elif fault == "bit63-layer":
            snap[i, 2] = ix.RESERVED
            snap[i, 5] = np.int64(-(1 << 63))           # only layer 63's bit
        elif fault == "foreign-tag":
            snap[i, 7] = (TAG + 1) << INDEX_FLAG_NS_SHIFT
        elif fault == "nbytes":
            snap[i, 4] = BB // 2
        elif fault == "below":
            snap[i, 3] = LO - BB
        elif fault == "past-end":
            snap[i, 3] = HI - BB + 64
        want = reference(snap, layer, TAG, INDEX_FLAG_NS_MASK)
        got = rows_fine(snap, layer, BB, LO, HI, TAG, INDEX_FLAG_NS_SHIFT, INDEX_FLAG_NS_MASK)
        assert got == want, (fault, layer, n)
        if fault in ("absent", "foreign-tag", "nbytes", "below", "past-end"):
            assert not got
        # mask 0: no layout guard, every tag passes
        assert rows_fine(snap, layer, BB, LO, HI, 0, INDEX_FLAG_NS_SHIFT, 0) == \
            reference(snap, layer, 0, 0)
