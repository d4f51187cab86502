"""fsck and the chunk heaps on a live region: a chunk claimed and not carved yet may still hold
the heap record of an earlier ownership (a dead node's chunks are reclaimed without clearing
their records); that is "claimed, not carved", not a problem (an online fsck beside node 1's
pre-claimer reported it after an online repair: the CI of ff2a033). A record newer than its
owner's generation, or one that its owner's carve should have written, stays a problem, and
an index entry into a chunk not carved by its owner is reported."""
from __future__ import annotations

import numpy as np

import tract_async as tract
import tract_kernels as K
from tract_async.keys import keys_to_words
from tract_async.region import layout as L
from tract_async.region.chunks import ChunkTable
from tract_async.tools.fsck import check, index_findings
from tests.support import procs_lock as P
from tests.support.engine_util import cfg, kv_for_keys

LIVENESS_S = 1.0
TOKEN = (1 << 32) | 7


def _no_check() -> None:
    pass


def _write_heap(table: ChunkTable, chunk: int, generation: int, slot_bytes: int) -> None:
    """A carve's heap record (meta line, empty bitmap), as the owner's allocator writes it."""
    g = table.geo
    rec = np.zeros((1 + g.heap_bitmap_lines) * L.LINE_BYTES, dtype=np.uint8)
    meta = rec[:L.LINE_BYTES].view(L.HEAP_META.dtype)
    meta["slot_bytes"] = slot_bytes
    meta["nslots"] = g.chunk_bytes // slot_bytes
    meta["generation"] = generation
    meta["used"] = 0
    K.write_bytes(table._region.mem, g.heap_off(chunk), rec.ctypes.data, rec.nbytes, 0)
    K.full_fence(table._region.mem)


def _heap_problems(r) -> list[str]:  # noqa: ANN001
    return [p for p in check(r, liveness_timeout_s=LIVENESS_S).problems if p.startswith("heap:")]


def test_a_claimed_chunk_with_an_earlier_owners_record_is_not_a_problem(region_path: str
                                                                          ) -> None:
    r = P.make_region(region_path, "hw")
    try:
        h = r.nodes.join(1, timeout_s=LIVENESS_S)
        table = ChunkTable(r)
        (c, gen), = table.claim_many(1, h.epoch, TOKEN, _no_check, 1)
        _write_heap(table, c, gen, 64 << 10)                 # carved under its generation
        assert _heap_problems(r) == []
        table.release(c, 1, h.epoch, TOKEN, _no_check)
        (c2, gen2), = table.claim_many(1, h.epoch, TOKEN, _no_check, 1)
        # the same chunk, its record left as the last ownership wrote it: claimed, not carved
        assert (c2, gen2) == (c, gen + 2)
        assert _heap_problems(r) == []
        _write_heap(table, c, gen2 + 1, 64 << 10)          # newer than its owner's: damage
        probs = _heap_problems(r)
        assert any(f"chunk {c} carved under generation {gen2 + 1}" in p for p in probs), probs
        _write_heap(table, c, gen2, 64 << 10)              # carved by its owner: clean again
        assert _heap_problems(r) == []
        table.release(c, 1, h.epoch, TOKEN, _no_check)
    finally:
        r.close()


async def test_an_entry_into_a_chunk_its_owner_did_not_carve_is_reported(region_path: str
                                                                         ) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        keys = eng.block_keys(list(range(64)))
        await eng.put_kv(keys, kv_for_keys(keys))
        st = eng._store
        r, table = st.alloc._region, st.alloc.table
        nodes = r.nodes.all()
        assert index_findings(r, table, nodes) == []
        entry = int(st.index.snapshot(keys_to_words(keys[:1]))[0, 0])
        c = (int(st.index.scan()[entry, 1]) - table.geo.chunks_offset) // table.geo.chunk_bytes
        gen = table.owner(c).generation
        _write_heap(table, c, gen - 1, 64 << 10)         # an earlier ownership's record
        found = index_findings(r, table, nodes)
        assert found and all("not carved by its owner" in f.reason for f in found), found
