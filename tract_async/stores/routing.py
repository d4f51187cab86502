"""Every threshold that picks the path of a put or a read, in one place (issue 37).

A put or a read of the region is one transaction (``stores/txn.py``) whatever moves its bytes;
what differs is the copy back-end, and which one a transfer takes is decided here, by its size
in blocks and bytes, its layer, and the copy threads this node has. The owners of each path
(``stores/region.py``, ``stores/cpucopy.py``, ``stores/parallel.py``, ``stores/small.py``,
``cuda/store.py``) read these names from this module at call time, so a test that changes one
(``monkeypatch.setattr(routing, ...)``) changes it for every path at once.

| name | value | what it picks |
|---|---|---|
| ``FUSED_MAX_BLOCKS`` | 8 | a put or get of at most this many whole blocks (and at most ``INLINE_COPY_BYTES``) is one kernel call (``stores/fused.py``); also the size of that kernel's scratch rows |
| ``INLINE_COPY_BYTES`` | 1 MiB | a copy up to this size runs on the event loop's thread, larger ones on the copy threads |
| ``PARALLEL_COPY_BYTES`` | 2 MiB | a copy from this size may be cut over several threads (hardware backend) |
| ``THREAD_MIN_BYTES`` | 1 MiB | each thread of a cut copy gets at least this much |
| ``LOOP_SHARE_MAX_BYTES`` | 8 MiB | the loop's thread copies one group of a cut copy itself up to this size |
| ``NT_READ_BYTES`` | 8 MiB | a get from this size writes its output with non-temporal stores |
| ``STAGE_BLOCKS`` | 512 | keys per stage of a staged put |
| ``STAGE_MIN_BLOCKS``, ``STAGE_MIN_BYTES`` | 2048, 16 MiB | a put of at least this many new blocks and bytes, with two or more copy threads, is staged |
| ``PARALLEL_MIN_BLOCKS`` | 32 | a read of fewer blocks keeps the step-by-step path instead of the parallel groups |
| ``PARALLEL_INVALIDATE_BYTES`` | 64 MiB | a GPU get from this size drops its cached payload lines from several threads |

The one-block fast path of the Engine (``stores/small.py``) is the fused path for one block,
taken before any of this when the key and tensor are of the exact expected kind.
"""
from __future__ import annotations

from typing import Any

FUSED_MAX_BLOCKS = 8
"""Puts and gets of at most this many blocks take the fused call, if their bytes are also at
most ``INLINE_COPY_BYTES`` (``fusable``): larger ones are copy-bound and keep the step-by-step
path, whose copies may run on several threads."""

INLINE_COPY_BYTES = 1 << 20
"""Copies up to this size run on the event loop (a thread hop costs ~50-150 µs)."""

NT_READ_BYTES = 8 << 20
"""Gets at least this large write their output with non-temporal stores (``read_rows``)."""

PARALLEL_COPY_BYTES = 2 << 20
"""Copies at least this large (hardware backend) may run on several threads (``threads_for``)."""

THREAD_MIN_BYTES = 1 << 20
"""Each thread of a parallel copy gets at least this much: below it the thread's wake-up
(~10-50 µs) is a good part of its copy time (1 MiB: ~70-200 µs at 5-15 GB/s)."""

LOOP_SHARE_MAX_BYTES = 8 << 20
"""With ``loop_share`` (the default), the loop's thread copies one group of a cut copy itself
when no group is larger than this, and a copy that would run on a single pool thread runs on
the loop's thread up to this size (no thread hop at all). At ~5-15 GB/s per thread that holds
the loop for at most ~0.5-1.6 ms -- time it would otherwise spend asleep waiting for the copy,
plus its 50-150 µs wake-up (``stores/copygang.py``). Larger groups all go to the workers, so a
256 MiB transfer never blocks the loop for its whole duration."""

STAGE_BLOCKS = 512
"""Keys per stage of a staged put (``stores/region.py``, "Staged large puts"): 32 MiB of whole
64 KiB blocks, ~1 ms of copy on the H200 host's eight copy threads against ~0.6 ms of
reservation, so the loop's reservation of the next stage hides under the copy of this one."""

STAGE_MIN_BLOCKS = 4 * STAGE_BLOCKS
STAGE_MIN_BYTES = 16 << 20
"""A put is staged from this many new blocks and bytes up, with at least two copy threads.
At least four stages: the first stage's reservation, which nothing hides, is then at most a
quarter of the whole. Below 16 MiB the copies are too short to hide anything, and each stage
costs a snapshot, a reservation and a copy hand-off (tens of µs). With one copy thread (a
2-core host) the copy thread and the loop share the cores: staged and unstaged 256 MiB puts
measured the same on the 2-core VM (18-20 ms), so those stay unstaged."""

PARALLEL_MIN_BLOCKS = 32
"""Reads of fewer blocks keep the step-by-step path (a group of a few blocks saves less
metadata time than its worker's hand-off costs: ``stores/parallel.py``)."""

PARALLEL_INVALIDATE_BYTES = 64 << 20
"""GPU gets at least this large drop their payload lines from several threads (hardware
backend: ``cuda/store.py``, ``drop_cached_payloads``)."""


def fusable(layout: Any, n: int, layer: int | None) -> bool:
    """A transfer of ``n`` blocks that the fused kernels take: whole blocks, at most
    ``FUSED_MAX_BLOCKS`` of them, and small enough to copy on the loop's thread."""
    return layer is None and n <= FUSED_MAX_BLOCKS and n * layout.block_bytes <= INLINE_COPY_BYTES


def stageable(layout: Any, n: int, layer: int | None, copy_threads: int) -> bool:
    """A put of ``n`` new blocks that is staged (``STAGE_MIN_BLOCKS``, ``STAGE_MIN_BYTES``)."""
    if n < STAGE_MIN_BLOCKS or copy_threads < 2:
        return False
    per = layout.block_bytes if layer is None else layout.layer_bytes
    # a stage copied inline on the loop (INLINE_COPY_BYTES) would overlap nothing
    return n * per >= STAGE_MIN_BYTES and STAGE_BLOCKS * per > INLINE_COPY_BYTES


def threads_for(nbytes: int, copy_threads: int) -> int:
    """Threads a copy of ``nbytes`` runs on (hardware backend): 1 below
    ``PARALLEL_COPY_BYTES``, else one per ``THREAD_MIN_BYTES``, at most ``copy_threads``."""
    if nbytes < PARALLEL_COPY_BYTES or copy_threads < 2:
        return 1
    return max(1, min(copy_threads, nbytes // THREAD_MIN_BYTES))


def put_path(layout: Any, n: int, layer: int | None, copy_threads: int) -> str:
    """The CPU path of a put of ``n`` blocks: ``"fused"``, ``"staged"`` or ``"cpu"`` (the
    step-by-step copy, on the loop or the copy threads by its bytes). A fused put that the
    kernel declines, and a staged put whose blocks are all in flight already, go on step by
    step."""
    if fusable(layout, n, layer):
        return "fused"
    return "staged" if stageable(layout, n, layer, copy_threads) else "cpu"
