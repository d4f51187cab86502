"""What a region created by the engine holds: the lock and allocator sections, then the prefix
index, then the chunk area (the rest). One function, used by ``Engine`` and ``tract region init``
so that both create the same thing."""
from __future__ import annotations

from .region import SectionSpec
from .region import index as ix
from .region.chunks import sections_for
from .stores import doorbell

DEFAULT_MIN_SLOT_BYTES = 4096


def region_sections(*, size_bytes: int, max_nodes: int, chunk_bytes: int = 2 << 20,
                    block_bytes: int = 64 << 10, index_capacity: int | None = None
                    ) -> list[SectionSpec]:
    """Sections for a region of ``size_bytes``: ``index_capacity`` entries (default: twice the
    number of ``block_bytes`` blocks that fit)."""
    min_slot = min(DEFAULT_MIN_SLOT_BYTES, chunk_bytes)
    secs = sections_for(size_bytes, max_nodes, chunk_bytes, min_slot_bytes=min_slot)
    # every block takes at least one slot of min_slot bytes; the index never takes more than
    # about 1/16 of the region (an entry is 128 bytes, capacity_for doubles the block count)
    blocks = size_bytes // max(block_bytes, min_slot, 1)
    blocks = min(blocks, size_bytes // (32 * ix.ENTRY_BYTES))
    cap = index_capacity or ix.capacity_for(max(1, blocks))
    index = SectionSpec(name="index", nbytes=ix.section_bytes(cap))
    bells = SectionSpec(name=doorbell.SECTION, nbytes=doorbell.section_bytes(max_nodes))
    return secs[:-1] + [bells, index, secs[-1]]


def initialize(region) -> None:  # noqa: ANN001
    """Format the sections that need more than zeroes (the index header)."""
    ix.PrefixIndex.format(region)
