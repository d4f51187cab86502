"""What a region created by the engine holds: the lock and allocator sections, the doorbells,
the namespace records, then the prefix index, then the chunk area (the rest). One function,
used by ``Engine`` and ``tract region init`` so that both create the same thing; and the
smallest region that holds one block (``min_region_bytes``), which both check before creating
one."""
from __future__ import annotations

from .errors import RegionTooSmall
from .region import SectionSpec
from .region import index as ix
from .region import layout as L
from .region import namespaces as ns
from .region.chunks import alloc_geometry, sections_for
from .region.region import DEFAULT_ROOT_SLOTS, place_sections
from .stores import doorbell
from .units import fmt_bytes

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


def chunk_area_bytes(*, size_bytes: int, max_nodes: int, chunk_bytes: int = 2 << 20,
                     block_bytes: int = 64 << 10, index_capacity: int | None = None) -> int:
    """Bytes of the chunk area of a region made by ``region_sections`` (0: none fits)."""
    secs = region_sections(size_bytes=size_bytes, max_nodes=max_nodes, chunk_bytes=chunk_bytes,
                           block_bytes=block_bytes, index_capacity=index_capacity)
    placed = place_sections(secs, size_bytes, max_nodes=max_nodes, root_slots=DEFAULT_ROOT_SLOTS)
    return 0 if placed is None else placed[-1].nbytes


def min_region_bytes(*, max_nodes: int, chunk_bytes: int = 2 << 20, block_bytes: int = 64 << 10,
                     index_capacity: int | None = None) -> int:
    """The smallest ``region_bytes`` (whole pages) whose chunk area holds one chunk, and so one
    block: below it a region can be created but every put fails.

    The metadata grows with the size (chunk records, the index), never shrinks, so growing the
    size by what the chunk area lacks never passes the least size that fits, and a few rounds
    reach it."""
    size = L.align_up(chunk_bytes, L.PAGE_BYTES)
    while True:
        have = chunk_area_bytes(size_bytes=size, max_nodes=max_nodes, chunk_bytes=chunk_bytes,
                                block_bytes=block_bytes, index_capacity=index_capacity)
        if have >= chunk_bytes:
            return size
        size = L.align_up(size + max(chunk_bytes - have, 1), L.PAGE_BYTES)


def initialize(region) -> None:  # noqa: ANN001
    """Format the sections that need more than zeroes (the index header: a lane per node id)."""
    ix.PrefixIndex.format(region, lanes=ix.lanes_for(region.max_nodes))


def check_create_size(*, path: str, region_bytes: int, max_nodes: int,
                      chunk_bytes: int = 2 << 20, block_bytes: int = 64 << 10,
                      index_capacity: int | None = None) -> None:
    """Refuse to create a region that could not hold one block (``min_region_bytes``): such a
    region is created fine and every put then fails. Raises RegionTooSmall naming the least
    ``region_bytes``."""
    least = min_region_bytes(max_nodes=max_nodes, chunk_bytes=chunk_bytes,
                             block_bytes=block_bytes, index_capacity=index_capacity)
    if region_bytes < least:
        raise RegionTooSmall(
            f"{path}: region_bytes={region_bytes} ({fmt_bytes(region_bytes)}) cannot hold one "
            f"{block_bytes}-byte block: with chunk_bytes={chunk_bytes} and max_nodes="
            f"{max_nodes}, the metadata leaves no room for a chunk below region_bytes={least} "
            f"({fmt_bytes(least)}); use at least that, or smaller chunks (EngineConfig."
            f"chunk_bytes)")


def check_holds_block(region, block_bytes: int) -> None:  # noqa: ANN001 (a Region)
    """Refuse an attached region that cannot hold one ``block_bytes`` block: its chunk area
    holds no chunk, or its chunks are smaller than a block. Raises RegionTooSmall."""
    g = alloc_geometry(region)
    if g.chunk_bytes < block_bytes:
        raise RegionTooSmall(
            f"{region.path}: its chunks of {g.chunk_bytes} bytes cannot hold one {block_bytes}-"
            f"byte block of this engine's layout; re-create the region with chunk_bytes >= "
            f"{block_bytes} (EngineConfig(create=True, overwrite=True, chunk_bytes=...))")
    if g.nchunks < 1:
        least = min_region_bytes(max_nodes=region.max_nodes, chunk_bytes=g.chunk_bytes,
                                 block_bytes=block_bytes)
        raise RegionTooSmall(
            f"{region.path}: {region.size_bytes} bytes hold no {g.chunk_bytes}-byte chunk, so not "
            f"one {block_bytes}-byte block; re-create it with region_bytes >= {least} "
            f"({fmt_bytes(least)})")
