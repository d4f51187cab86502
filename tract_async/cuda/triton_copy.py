"""A table-driven row copy in Triton: the zero-copy path between device memory and the mapped region.

One program copies one chunk of one row: it reads the row's (source, destination) offsets from
a table and moves ``BLOCK`` 32-bit words with 16-byte vector loads and stores. Either side may be
the registered region (host memory mapped for the device: its device address is its host
address under UVA), so the same kernel is the scatter-store of a put (device -> region, the stores
cross PCIe as posted writes) and the gather-load of a get.

Offsets are relative to two anchor tensors and counted in 16-byte units, so that the compiler
knows every access is 16-byte aligned (the table stores ``offset // 16``; ``* 4`` words makes the
alignment visible to Triton's axis analysis). Anchors let one table address rows of several
tensors (one pool tensor per layer): an offset is ``row_address - anchor_address``, possibly
negative, in int64.

Importing this module imports triton; ``available()`` tells whether that works.
"""
from __future__ import annotations

from typing import Any

_ERR: str | None = None
try:
    import triton
    import triton.language as tl
except Exception as e:  # CPU-only installs: the engine uses DMA paths only
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _ERR = f"{type(e).__name__}: {e}"

ALIGN_BYTES = 16
MAX_BLOCK_WORDS = 4096


def available() -> tuple[bool, str]:
    return triton is not None, _ERR or ""


if triton is not None:
    @triton.jit
    def _copy_rows(src_ptr, dst_ptr, table_ptr, row_words, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        s = tl.load(table_ptr + 2 * r) * 4          # in 32-bit words, a multiple of 4
        d = tl.load(table_ptr + 2 * r + 1) * 4
        s = tl.multiple_of(s, 4)
        d = tl.multiple_of(d, 4)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
        x = tl.load(src_ptr + s + offs)
        tl.store(dst_ptr + d + offs, x)


def block_words(row_bytes: int) -> int:
    """The largest power of two <= MAX_BLOCK_WORDS that divides the row (no masks needed)."""
    words = row_bytes // 4
    b = 1
    while b * 2 <= MAX_BLOCK_WORDS and words % (b * 2) == 0:
        b *= 2
    return b


def supported(row_bytes: int) -> bool:
    return row_bytes > 0 and row_bytes % ALIGN_BYTES == 0


def copy_rows(src_anchor: Any, dst_anchor: Any, table: Any, row_bytes: int) -> None:
    """Launch on the current stream: row ``k`` moves ``row_bytes`` from
    ``src_anchor + table[k, 0]*16`` to ``dst_anchor + table[k, 1]*16``.

    ``src_anchor``/``dst_anchor``: int32 tensors (device tensors or the registered region viewed
    as int32); ``table``: int64 device tensor ``(K, 2)``.
    Warning: nothing here checks that the rows lie inside live allocations.
    """
    k = int(table.shape[0])
    if k == 0:
        return
    words = row_bytes // 4
    blk = block_words(row_bytes)
    grid = (k, words // blk)
    _copy_rows[grid](src_anchor, dst_anchor, table, words, BLOCK=blk,
                     num_warps=4 if blk >= 512 else 1)
