"""One kernel call for a whole small put or get: the steps of the block lifecycle fused.

Why. A 64 KiB put spent ~100 µs on the 2-core VM and ~53 µs on the H200 host, of which the copy
was 8 µs and the reservation kernel ~1 µs: the rest was Python between the steps (allocation
records, a snapshot, a reservation, plan arrays, a publish, each with its own arrays, checks and
Numba argument unboxing). NIXL's whole 64 KiB handoff is 14-32 µs. So a put of a few whole
blocks (``FUSED_MAX_BLOCKS``, every layer at once, at most 1 MiB) and a get of a few READY
blocks each run as one jitted call made of the same jitted steps, in the same order, with the
same stores, flushes and fences as the step-by-step path (``stores/blocks.py``, ``region/index.py``); nothing of the
protocol is new here, only the Python between the steps is gone.

``put_blocks`` (the lane owner, lock-free: index.py "Who writes what"):

1. the fencing check (``Allocator.check_not_fenced``: this node was not judged dead);
2. ``reserve_batch`` in this node's lane, with payload slots the caller took from its spares
   (``BlockLifecycle``: slots allocated ahead, in batches, from this node's free lists; a key
   already live anywhere is skipped, as the snapshot of the step-by-step path skipped it);
3. if a key's probe window held no free entry of the lane: stop (status -2) with the other
   keys reserved, which the caller takes back (``_undo``) before the locked path runs;
4. the lane's ``publishes`` counter, bumped by the keys reserved (``reserve_batch_counted``);
5. ``write_rows`` of every reserved block (non-temporal stores, one ``sfence``);
6. ``publish_and_look``: every layer bit, then READY, then the doorbell lines read.

``get_blocks`` (any node, lock-free: index.py's seqlock read):

1. ``snapshot_batch``; any key absent or not READY, or with payload bounds outside the chunks
   or not one block, or stored under another namespace: stop (status -1 / -2) with the
   snapshot, for the step-by-step path to wait on or to raise from;
2. ``read_rows`` (invalidate every line, ``mfence``, copy);
3. ``revalidate_batch`` (entry, version, payload and slot tag still the snapshot's), unless the
   caller switched validation off (the torn-read stress's negative control).

The parameter array ``p`` holds what is constant for one node and region (``P_*``); the caller
builds it once.

Holding the GIL. Both kernels are compiled with ``nogil=False``: they keep the GIL for their
few to ~100 µs. A call that releases the GIL and takes it back costs ~0.2 µs in a process with
one thread, but ~7.5 µs (median, 2-core VM, CPython 3.11) in any process where another thread
has once waited for the GIL -- every engine process: the heartbeat and lock-manager threads
wake while the loop runs Python -- whenever the loop ran Python for more than ~50 µs since its
last release, that is, on the first call after any wake-up (``bench/gil.py`` reproduces it
without the engine: 7.6 µs against 0.15 µs for the same no-op holding the GIL). A 64 KiB put
right after the loop woke measured 43 µs with these kernels releasing the GIL and 35 µs
holding it (14 µs back to back either way); ctypes calls pay the same, so it is the
interpreter's hand-off, not Numba's. (Why the hand-off costs that much after a thread woke
once is not known; it does not show as a futex call in ``strace``.)
Kernels that can run long (copies above ``INLINE_COPY_BYTES``, polls with a deadline, the
copy gang's) still release it; the short ones the loop calls on every small transfer hold it:
these two, the doorbell's (``doorbell.py``) and small snapshots (``PrefixIndex.snapshot``).
The loop's 20 µs spin slices of a wait (``readiness.ReadyWaits._spin_on_loop``) were tried holding
it and went back: the waiting consumer's handoff part rose from ~10 to ~20 µs (median of
eleven 2-process runs each on the VM), as the lock manager's threads of that process then
found the GIL taken through the whole spin instead of between its polls.
"""
from __future__ import annotations

import numpy as np
from numba import njit

import tract_kernels as K

from ..region import gangcopy as G
from ..region import index as ix
from ..region.chunks import S_COUNT_READ
from .doorbell import waiting_mask
from . import routing as R

FUSED_MAX_BLOCKS = R.FUSED_MAX_BLOCKS
"""``routing.FUSED_MAX_BLOCKS``: also the size of the fused calls' scratch rows (fixed at import)."""

# the parameter array p (int64), built once per node (BlockLifecycle.fused_params)
P_LOFF = 0          # this lane's counter line
P_EOFF = 1          # index entries
P_MASK = 2          # index capacity - 1
P_MAX_PROBE = 3
P_LANES = 4
P_LANE = 5
P_PRODUCER = 6
P_FLAGS = 7         # FLAG_TRANSFER or 0, and the namespace tag's bits
P_ALL_LO = 8        # every layer's bits (two's complement of the uint64)
P_ALL_HI = 9
P_DBOFF = 10        # the doorbell section, -1 without one
P_DBNODES = 11
P_FENCE_OFF = 12    # this node's allocator count line + 8: the epoch it was fenced at
P_EPOCH = 13
P_POS_STEP = 14     # tensor bytes between blocks of one row (plan template)
P_CHUNKS_LO = 15    # payload bounds: the first chunk's offset
P_CHUNKS_END = 16   # and the end of the last
P_BLOCK_BYTES = 17
P_NS_TAG = 18       # this node's namespace tag (region/namespaces.py); 0 until recorded
P_FIELDS = 19

FENCED = -1
"""``put_blocks``: this node was judged dead (NodeEvicted); nothing was written."""
WINDOW_FULL = -2
"""``put_blocks``: some key found no free entry of the lane; ``res`` rows >= 0 are reserved."""
NOT_READY = G.NOT_READY
"""``get_blocks``: some key absent or not READY (``snap`` says which)."""
BAD_BOUNDS = G.BAD_BOUNDS
"""``get_blocks``: some snapshot's payload bounds do not fit (changed during the read)."""


@njit(cache=True)            # holds the GIL (module docstring, "Holding the GIL")
def put_blocks(m, p, tgeo, keys, ainfo, tmpl, src_base, now_ns, deadline_ns, res):
    """The whole put of ``keys`` (module docstring): ``ainfo`` rows (payload offset, nbytes,
    owner word, token) of slots this node owns, one per key; ``res`` rows as ``reserve_batch``
    leaves them (slot, previous state, version; slot <= -2: already live, skipped).

    Returns FENCED, WINDOW_FULL, or the doorbell's waiting mask (>= 0) once published."""
    ep = K.load_fresh(m, p[P_FENCE_OFF], S_COUNT_READ)
    if np.int64(ep) >= p[P_EPOCH]:
        return np.int64(FENCED)
    eoff, lanes = p[P_EOFF], p[P_LANES]
    ix.reserve_batch(m, eoff, tgeo, p[P_MASK], p[P_MAX_PROBE], lanes, p[P_LANE], keys,
                     ainfo[:, 0], ainfo[:, 1], ainfo[:, 2], ainfo[:, 3], now_ns, p[P_PRODUCER],
                     p[P_FLAGS], deadline_ns, res)
    n = keys.shape[0]
    got = 0
    for i in range(n):
        if res[i, 0] == -1:
            return np.int64(WINDOW_FULL)
        if res[i, 0] >= 0:
            got += 1
    if got == 0:
        return np.int64(0)
    cur = K.load_fresh(m, p[P_LOFF] + ix.LN_PUBLISHES, ix.S_IX_READ)
    K.store_flush(m, p[P_LOFF] + ix.LN_PUBLISHES, cur + np.uint64(got), ix.S_IX_HDR)
    poffs = np.empty(got, dtype=np.int64)
    positions = np.empty(got, dtype=np.int64)
    slots = np.empty(got, dtype=np.int64)
    j = 0
    for i in range(n):
        if res[i, 0] >= 0:
            poffs[j] = np.int64(ainfo[i, 0])
            positions[j] = i
            slots[j] = res[i, 0]
            j += 1
    K.write_rows(m, ix.shifted_rows(tmpl, poffs, positions, p[P_POS_STEP]), src_base,
                 ix.S_IX_PAYLOAD_WRITE)
    all_lo, all_hi = np.uint64(p[P_ALL_LO]), np.uint64(p[P_ALL_HI])
    ix.publish_layers(m, eoff, slots, all_lo, all_hi, all_lo, all_hi)
    if p[P_DBOFF] < 0:
        return np.int64(0)
    return waiting_mask(m, p[P_DBOFF], p[P_DBNODES])


@njit(cache=True)            # holds the GIL (module docstring, "Holding the GIL")
def get_blocks(m, p, tgeo, keys, tmpl, dst_base, validate, snap, ok):
    """The whole get of READY ``keys`` into private memory at ``dst_base`` (module docstring).
    ``snap`` rows as ``snapshot_batch`` writes them; ``ok[i]``: block i revalidated.

    Returns NOT_READY or BAD_BOUNDS (nothing copied), else the number of blocks that failed
    revalidation (0: the output is good)."""
    # the checked read of a parallel read's group (``region/gangcopy.py``), whole blocks,
    # cached destination stores, no test seam; called from here it keeps the GIL
    return G.get_checked(m, p[P_EOFF], p[P_MASK], p[P_MAX_PROBE], p[P_LANES], p[P_CHUNKS_LO],
                         p[P_CHUNKS_END], p[P_BLOCK_BYTES], p[P_POS_STEP], p[P_NS_TAG], tgeo,
                         keys, tmpl, dst_base, validate, True, 0, np.uint64(1), False, snap, ok,
                         0)
