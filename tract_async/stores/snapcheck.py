"""One pass over a read's snapshot: every block present, available, of this engine's layout and
inside the payload area, or where the step-by-step checks must look.

Why. ``BlockLifecycle.prepare_read`` checked a snapshot of more than ``SMALL_READ`` blocks with
a dozen numpy operations (availability, namespace tags, payload bounds: ~1 µs each plus their
temporaries): ~50 µs of a 32-block layer read's ~58 µs on the 2-core VM, where the snapshot
itself took 5, and 2-3x that on the GPU hosts, on the critical path of every layer a decode
worker reads. The common outcome -- everything fine -- needs one loop over the rows; anything
else goes to the existing checks, which name the block and raise the right error. It keeps
the GIL (``stores/fused.py``, "Holding the GIL"): released, the hand-off to a waiting thread (the
CUDA poller, the lock manager) cost more than the whole check on the GPU hosts (a 32-block
layer read's prepare measured 41 µs on the H100 host with this kernel releasing it).

Snapshot columns (``PrefixIndex.snapshot``): 0 slot (-1 absent), 1 version, 2 state, 3 payload
offset, 4 nbytes, 5-6 layer bits (lo, hi), 7 flags (namespace tag at ``shift``).
"""
from __future__ import annotations

from numba import njit

from ..region import index as ix
from ..region.index import SNAP_FLAGS, SNAP_NBYTES, SNAP_POFF, SNAP_SLOT, SNAP_STATE

READY = ix.READY


@njit(cache=True)             # holds the GIL: see the module docstring
def rows_fine(snap, layer, block_bytes, lo, hi, tag, shift, mask):
    """True when every row is present and available (READY; or, for ``layer`` >= 0, its layer
    bit set), has namespace tag ``tag`` (``(flags >> shift) & mask``; mask 0 skips it), and a
    payload ``[offset, offset + block_bytes)`` of exactly ``block_bytes`` within ``[lo, hi)``.
    False means: run the step-by-step checks (they raise, or accept another readable tag)."""
    n = snap.shape[0]
    col = 5 + (layer // 64 if layer >= 0 else 0)
    bit = layer % 64 if layer >= 0 else 0
    for i in range(n):
        if snap[i, SNAP_SLOT] < 0:
            return False
        if snap[i, SNAP_STATE] != READY:
            if layer < 0 or ((snap[i, col] >> bit) & 1) == 0:
                return False
        if ((snap[i, SNAP_FLAGS] >> shift) & mask) != tag:
            return False
        off = snap[i, SNAP_POFF]
        if snap[i, SNAP_NBYTES] != block_bytes or off < lo or off > hi - block_bytes:
            return False
    return True
