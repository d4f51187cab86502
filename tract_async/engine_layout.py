"""What a region created by the engine holds: the lock and allocator sections, the doorbells,
the namespace records, then the prefix index, then the chunk area (the rest). One function,
used by ``Engine`` and ``tract region init`` so that both create the same thing."""
from __future__ import annotations

from .region import SectionSpec
from .region import index as ix
from .region import namespaces as ns
from .region.chunks import sections_for
from .stores import doorbell

DEFAULT_MIN_SLOT_BYTES = 4096


def region_sections(*, size_bytes: int, max_nodes: int, chunk_bytes: int = 2 << 20,
                    block_bytes: int = 64 << 10, index_capacity: int | None = None
                    ) -> list[SectionSpec]:
    """Sections for a region of ``size_bytes``: ``index_capacity`` entries (default: twice the
    number of ``block_bytes`` blocks that fit, per lane, at most about 1/8 of the region)."""
    min_slot = min(DEFAULT_MIN_SLOT_BYTES, chunk_bytes)
    secs = sections_for(size_bytes, max_nodes, chunk_bytes, min_slot_bytes=min_slot)
    # every block takes at least one slot of min_slot bytes. A node reserves only in its own
    # lane (index.py), so each lane gets room for twice the region's blocks, as the whole table
    # had with one lane; the index never takes more than about 1/8 of the region (a lane then
    # holds fewer, and a node that alone fills the region evicts its oldest in a full window)
    blocks = size_bytes // max(block_bytes, min_slot, 1)
    cap = ix.capacity_for(max(1, blocks)) * ix.lanes_for(max_nodes)
    most = 64
    while most * 2 * ix.ENTRY_BYTES * 8 <= size_bytes:
        most *= 2
    cap = index_capacity or max(64, min(cap, most))
    index = SectionSpec(name="index", nbytes=ix.section_bytes(cap))
    bells = SectionSpec(name=doorbell.SECTION, nbytes=doorbell.section_bytes(max_nodes))
    names = SectionSpec(name=ns.SECTION, nbytes=ns.section_bytes())
    return secs[:-1] + [bells, names, index, secs[-1]]


def initialize(region) -> None:  # noqa: ANN001
    """Format the sections that need more than zeroes (the index header: a lane per node id)."""
    ix.PrefixIndex.format(region, lanes=ix.lanes_for(region.max_nodes))
