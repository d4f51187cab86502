"""Worker functions for multi-process region tests (spawned: they must be importable)."""
from __future__ import annotations

import time

import tract_kernels as K
from tract_async.region import Region
from tract_async.region import nodes as nodes_mod


def join_beat_leave(path: str, backend: str, node_id: int, beats: int, period_s: float,
                    q, may_leave) -> None:  # noqa: ANN001 (multiprocessing queue, event)
    r = Region.attach(path, backend=backend, sim_seed=node_id + 100)
    try:
        h = r.nodes.join(node_id)
        q.put(("joined", node_id, h.epoch))
        for _ in range(beats):
            time.sleep(period_s)
            r.nodes.heartbeat(h)
        q.put(("beating-done", node_id, r.nodes.info(node_id).heartbeat_seq))
        assert may_leave.wait(60), "the test never let this node leave"
        r.nodes.leave(h)
        q.put(("left", node_id, 0))
    finally:
        r.close()


def join_and_hang(path: str, backend: str, node_id: int, q) -> None:  # noqa: ANN001
    r = Region.attach(path, backend=backend, sim_seed=node_id + 200)
    r.nodes.join(node_id)
    q.put(("joined", node_id, 0))
    time.sleep(600)   # killed by the test


def publish_root(path: str, backend: str, name: str, offset: int, q) -> None:  # noqa: ANN001
    r = Region.attach(path, backend=backend, sim_seed=7)
    try:
        # the test runs with no other node alive, standing in for "holding the global lock"
        e = r.root.publish(name, offset, 4096, kind=3, holding_lock=True)
        q.put(("published", e.slot_index, 0))
    finally:
        r.close()


def read_root(path: str, backend: str, name: str, q) -> None:  # noqa: ANN001
    r = Region.attach(path, backend=backend, sim_seed=8)
    try:
        e = r.root.lookup(name)
        q.put(("found", e.offset_bytes, e.kind))
    finally:
        r.close()


class StaleSnapshotBeats:
    """Node ``node_id``'s beats as a host whose snapshot looks stale although it is alive (its
    stamps lag by ``lag_s``, as every node's do right after a stall of the whole host or a clock
    step): stamps and sequence written like ``_stamp``, from the test's thread."""

    def __init__(self, r: Region, node_id: int, lag_s: float) -> None:
        self.r, self.lag_ns = r, int(lag_s * 1e9)
        self.off = r.nodes.line_offset(node_id)
        self.f = nodes_mod._F

    def beat(self) -> None:
        m, off, f = self.r.mem, self.off, self.f
        seq = int(K.load_fresh(m, off + f["heartbeat_seq"], K.NO_SITE))
        K.store(m, off + f["heartbeat_ns"], time.time_ns() - self.lag_ns)
        K.store(m, off + f["heartbeat_seq"], seq + 1)
        K.flush(m, off, K.NO_SITE)
        K.full_fence(m)


def create_held_in_init(path: str, engine_sections: bool, q, go) -> None:  # noqa: ANN001
    """Create a region whose initialization waits for ``go``: a creator that is alive and
    still at it for as long as the test wants. ``engine_sections``: lay it out as an Engine
    does, so that an Engine can attach once it is READY."""
    import os
    sections: list = []
    init_sections = None
    if engine_sections:
        from tract_async.engine_layout import initialize, region_sections
        sections = region_sections(size_bytes=32 << 20, max_nodes=8, chunk_bytes=1 << 20,
                                   block_bytes=16 << 10)
        init_sections = initialize

    def initialize_and_wait(r: Region) -> None:
        if init_sections is not None:
            init_sections(r)
        q.put(("initializing", os.getpid(), 0))
        assert go.wait(120), "the test never let the creator finish"

    r = Region.create(path, 32 << 20, max_nodes=8, sections=sections,
                      initialize=initialize_and_wait)
    q.put(("ready", str(r.uuid), 0))
    assert go.wait(120)
    r.close()
