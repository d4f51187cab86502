"""fsck and the allocator's journal on a live region: a batch that a live node has in flight
is not a batch left PENDING (an online fsck beside a node's background chunk claims reported
one, after an online repair: the CI of ae25a12); a batch that stays PENDING is a problem,
whoever holds it."""
from __future__ import annotations

import threading
import time

from tract_async.region.chunks import OP_NAMES, ChunkTable
from tract_async.tools.fsck import check
from tests.support import procs_lock as P

LIVENESS_S = 1.0


def _pending(table: ChunkTable, node: int) -> None:
    op = next(iter(OP_NAMES))
    table._journal_begin(op, node, 1, (1 << 32) | 7, 0, 1)


def test_a_live_nodes_batch_in_flight_is_a_note_not_a_problem(region_path: str) -> None:
    r = P.make_region(region_path, "hw")
    try:
        r.nodes.join(1, timeout_s=LIVENESS_S)
        table = ChunkTable(r)
        _pending(table, 1)
        ends = threading.Timer(0.05, table._journal_end)   # the batch completes meanwhile
        ends.start()
        rep = check(r, liveness_timeout_s=LIVENESS_S)
        ends.join()
        assert not any(p.startswith("journal:") for p in rep.problems), rep.text()
        assert any("by live node 1 was in flight" in n for n in rep.notes), rep.text()
    finally:
        r.close()


def test_a_batch_that_stays_pending_is_a_problem_live_or_dead(region_path: str) -> None:
    r = P.make_region(region_path, "hw")
    try:
        r.nodes.join(1, timeout_s=LIVENESS_S)
        table = ChunkTable(r)
        _pending(table, 1)                  # live, but the batch never moves
        t0 = time.monotonic()
        rep = check(r, liveness_timeout_s=LIVENESS_S)
        assert time.monotonic() - t0 >= LIVENESS_S       # it waited for the batch to move
        assert any(p.startswith("journal:") and "left PENDING" in p for p in rep.problems)
        _pending(table, 3)                  # node 3 never joined: not live, no wait
        rep = check(r, liveness_timeout_s=LIVENESS_S)
        assert any("by node 3" in p and "left PENDING" in p for p in rep.problems), rep.text()
        table._journal_end()
        rep = check(r, liveness_timeout_s=LIVENESS_S)
        assert not any(p.startswith("journal:") for p in rep.problems), rep.text()
    finally:
        r.close()
