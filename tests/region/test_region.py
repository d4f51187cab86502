"""Region create/attach/validate, bad input, node table and root directory across processes."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tract_async import errors as E
from tract_async.region import Region, SectionSpec, default_path, remove
from tract_async.region import layout as L
from tract_async.region import region as region_mod
from tests.support import procs_region as P

SPAWN = mp.get_context("spawn")


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _make(path: str, backend: str = "hw", **kw) -> None:
    Region.create(path, 1 << 22, max_nodes=4, backend=backend, **kw).close()


def test_default_path() -> None:
    assert default_path("demo") == "/dev/shm/tract-demo"


def test_create_attach_roundtrip(region_path: str, backend: str) -> None:
    secs = [SectionSpec(name="locks", nbytes=8192), SectionSpec(name="rest", nbytes=-1)]
    with Region.create(region_path, 1 << 22, max_nodes=4, sections=secs, backend=backend) as a:
        with Region.attach(region_path, backend=backend, sim_seed=9) as b:
            assert a.uuid == b.uuid and b.max_nodes == 4 and b.size_bytes == 1 << 22
            assert b.backing.kind == "tmpfs"
            assert b.header["init_state"] == L.INIT_READY
            s = b.section("locks")
            assert s.nbytes == 8192 and s.offset_bytes % 4096 == 0
            rest = b.section("rest")
            assert rest.offset_bytes + rest.nbytes == 1 << 22
    with pytest.raises(E.RegionExists):
        Region.create(region_path, 1 << 22)


def test_create_overwrite_gives_new_generation(region_path: str) -> None:
    with Region.create(region_path, 1 << 22) as a:
        first = a.uuid
    with Region.create(region_path, 1 << 22, overwrite=True) as b:
        assert b.uuid != first


# ---- bad input: each a typed error, and the file unchanged ----------------------------------

def test_missing_file(region_path: str) -> None:
    with pytest.raises(E.RegionNotFound, match="no such region"):
        Region.attach(region_path)
    assert not os.path.exists(region_path)


def test_foreign_file(region_path: str) -> None:
    with open(region_path, "wb") as f:
        f.write(np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    before = _digest(region_path)
    with pytest.raises(E.RegionCorrupt, match="not a tract region"):
        Region.attach(region_path)
    assert _digest(region_path) == before


def test_truncated_file(region_path: str) -> None:
    _make(region_path)
    os.truncate(region_path, 1 << 20)
    before = _digest(region_path)
    with pytest.raises(E.RegionTruncated, match="header records 4194304 bytes, the file holds 1048576"):
        Region.attach(region_path)
    assert _digest(region_path) == before
    os.truncate(region_path, 40)
    with pytest.raises(E.RegionTruncated, match="smaller than"):
        Region.attach(region_path)


def _patch_word(path: str, offset: int, value: int, size: int = 8) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value.to_bytes(size, "little"))


def test_version_mismatch(region_path: str) -> None:
    _make(region_path)
    _patch_word(region_path, 8, L.FORMAT_VERSION + 1, 4)
    before = _digest(region_path)
    with pytest.raises(E.RegionVersionMismatch, match=f"version {L.FORMAT_VERSION + 1}, this build "
                       f"reads version {L.FORMAT_VERSION}"):
        Region.attach(region_path)
    assert _digest(region_path) == before


def test_signature_mismatch(region_path: str) -> None:
    _make(region_path)
    _patch_word(region_path, 16, 0x1234)
    before = _digest(region_path)
    with pytest.raises(E.RegionLayoutMismatch, match="0x0000000000001234 differs from this build's"):
        Region.attach(region_path)
    assert _digest(region_path) == before


def test_damaged_header_checksum(region_path: str) -> None:
    _make(region_path)
    _patch_word(region_path, 48, 3, 4)     # max_nodes changed behind the checksum's back
    with pytest.raises(E.RegionCorrupt, match="checksum"):
        Region.attach(region_path)


def test_never_initialized(region_path: str) -> None:
    _make(region_path)
    _patch_word(region_path, L.INIT_STATE_OFFSET, 0)
    with pytest.raises(E.RegionCorrupt, match="never fully initialized"):
        Region.attach(region_path)


def test_too_small_for_max_nodes(region_path: str) -> None:
    with pytest.raises(E.RegionTooSmall, match="max_nodes=4096"):
        Region.create(region_path, 64 << 10, max_nodes=4096)
    assert not os.path.exists(region_path), "a failed create must not leave a file behind"
    with pytest.raises(E.RegionTooSmall, match="big=1048576"):
        Region.create(region_path, 1 << 20, sections=[SectionSpec(name="big", nbytes=1 << 20)])


def test_node_id_out_of_range(region_path: str) -> None:
    _make(region_path)
    with Region.attach(region_path) as r:
        before = _digest(region_path)
        for bad in (-1, 4, 99):
            with pytest.raises(E.NodeIdOutOfRange, match="ids 0..3"):
                r.nodes.join(bad)
        assert _digest(region_path) == before


def test_node_id_held_in_same_process(region_path: str, backend: str) -> None:
    _make(region_path, backend)
    with Region.attach(region_path, backend=backend) as a, \
            Region.attach(region_path, backend=backend, sim_seed=3) as b:
        h = a.nodes.join(1)
        with pytest.raises(E.NodeIdInUse, match="held by a live process"):
            b.nodes.join(1)
        a.nodes.leave(h)
        h2 = b.nodes.join(1)
        assert h2.epoch == h.epoch + 1
        b.nodes.leave(h2)


def test_node_id_held_by_live_process(region_path: str, backend: str) -> None:
    _make(region_path, backend)
    q = SPAWN.Queue()
    p = SPAWN.Process(target=P.join_and_hang, args=(region_path, backend, 2, q))
    p.start()
    try:
        assert q.get(timeout=60)[0] == "joined"
        with Region.attach(region_path, backend=backend) as r:
            with pytest.raises(E.NodeIdInUse, match=f"pid {p.pid}"):
                r.nodes.join(2)
            p.kill()
            p.join()
            # the OFD lock died with the process; the heartbeat stops; after the timeout the
            # id is free again
            time.sleep(0.35)
            h = r.nodes.join(2, timeout_s=0.3)
            assert h.epoch == 2
            r.nodes.leave(h)
    finally:
        if p.is_alive():
            p.kill()
        p.join()


def test_permission_denied(region_path: str) -> None:
    _make(region_path)
    os.chmod(region_path, 0o600)
    # Root ignores file modes, so the child drops to an unprivileged effective uid after its
    # imports (an unprivileged user could not exec this venv's interpreter at all).
    drop = "os.setegid(65534); os.seteuid(65534)\n" if os.geteuid() == 0 else ""
    code = ("import os, sys\nfrom tract_async.region import Region\nfrom tract_async import errors as E\n"
            + drop +
            f"try:\n    Region.attach({region_path!r})\nexcept E.RegionPermissionError as e:\n"
            "    print('PERM', e); sys.exit(0)\nsys.exit(3)\n")
    if not drop:
        os.chmod(region_path, 0o000)
    before = _digest(region_path)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "permission denied" in res.stdout
    assert _digest(region_path) == before


def test_devdax_size_from_sysfs(tmp_path) -> None:
    d = tmp_path / "bus" / "dax" / "devices" / "dax0.0"
    d.mkdir(parents=True)
    (d / "size").write_text(str(8 << 30) + "\n")
    (d / "align").write_text(str(2 << 20) + "\n")
    assert region_mod.devdax_size("/dev/dax0.0", sysfs_root=str(tmp_path)) == (8 << 30, 2 << 20)
    with pytest.raises(E.RegionNotFound, match="devdax"):
        region_mod.devdax_size("/dev/dax9.9", sysfs_root=str(tmp_path))


def test_hugetlbfs_pagesize_parsing() -> None:
    assert region_mod._hugepage_bytes("rw,pagesize=1G") == 1 << 30
    assert region_mod._hugepage_bytes("rw,pagesize=2M") == 2 << 20


# ---- node table and root directory across real processes -------------------------------------

def test_join_heartbeat_leave_across_processes(region_path: str, backend: str) -> None:
    _make(region_path, backend)
    q = SPAWN.Queue()
    may_leave = {i: SPAWN.Event() for i in (0, 3)}
    procs = [SPAWN.Process(target=P.join_beat_leave,
                           args=(region_path, backend, i, 5, 0.05, q, may_leave[i]))
             for i in (0, 3)]
    for p in procs:
        p.start()
    with Region.attach(region_path, backend=backend, sim_seed=55) as r:
        seen: dict[str, set[int]] = {}
        while len(seen.get("left", ())) < 2:
            kind, node, val = q.get(timeout=90)
            seen.setdefault(kind, set()).add(node)
            if kind == "beating-done":
                # the observer (another node with its own cache) sees the node live, beating
                info = r.nodes.info(node)
                assert info.live and info.heartbeat_seq == val == 5
                may_leave[node].set()
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        infos = r.nodes.all()
        assert [i.state_name for i in infos] == ["left", "free", "free", "left"]
        assert not any(i.live for i in infos)


def test_liveness_from_heartbeat_age(region_path: str, backend: str) -> None:
    _make(region_path, backend)
    with Region.attach(region_path, backend=backend) as r:
        h = r.nodes.join(0)
        assert r.nodes.is_live(0, timeout_s=5.0)
        time.sleep(0.2)
        assert not r.nodes.is_live(0, timeout_s=0.1)     # stale heartbeat
        r.nodes.heartbeat(h)
        assert r.nodes.is_live(0, timeout_s=0.1)
        r.nodes.leave(h)


def test_dead_needs_silence_counted_in_own_beats(region_path: str, backend: str) -> None:
    """``NodeInfo.dead`` (what revocation and reclaim act on): a stale snapshot alone is not
    death while the node's sequence still moves; silence across this process's own beats is;
    a process without a beat loop falls back to the snapshot verdict."""
    import threading
    import numpy as np
    from tract_async.region import nodes as nodes_mod
    _make(region_path, backend)
    timeout, interval = 0.4, 0.02
    need = max(nodes_mod.CONFIRM_MIN_BEATS, int(np.ceil(timeout / (4 * interval))))   # 5
    with Region.attach(region_path, backend=backend, sim_seed=3) as r, \
            Region.attach(region_path, backend=backend, sim_seed=4) as tool:
        me = r.nodes.join(0, timeout_s=timeout)
        other = r.nodes.join(1, timeout_s=timeout)
        host = P.StaleSnapshotBeats(r, 1, lag_s=10 * timeout)
        host.beat()
        # before our own beat loop runs there is nothing to count with: the snapshot verdict
        snap = r.nodes.all(timeout_s=timeout)[1]
        assert not snap.live and snap.dead
        stop = np.zeros(1, dtype=np.uint64)
        beater = threading.Thread(target=r.nodes.beat_until_stopped, args=(me, interval, stop))
        beater.start()
        try:
            time.sleep(0.05)
            t_end = time.monotonic() + 6 * need * interval
            while time.monotonic() < t_end:           # stale, but its sequence moves: alive
                host.beat()
                infos = r.nodes.all(timeout_s=timeout)
                assert not infos[1].live and not infos[1].dead, infos[1]
                assert infos[0].live and not infos[0].dead
                time.sleep(interval / 2)
            # a tool process (no beat loop) and confirm=False keep the snapshot verdict
            assert tool.nodes.all(timeout_s=timeout)[1].dead
            assert r.nodes.all(timeout_s=timeout, confirm=False)[1].dead
            # now it goes silent (one last beat): dead only after `need` of our own beats
            host.beat()
            seq0 = r.nodes.info(0).heartbeat_seq
            t0 = time.monotonic()
            assert not r.nodes.all(timeout_s=timeout)[1].dead      # first sight of this seq
            while not r.nodes.all(timeout_s=timeout)[1].dead:
                assert time.monotonic() - t0 < 5, "a silent node was never judged dead"
                time.sleep(interval / 4)
            took = time.monotonic() - t0
            beats = r.nodes.info(0).heartbeat_seq - seq0
            assert beats >= need and took >= (need - 1) * interval, (beats, took)
            # a node that left is dead at once, whatever its heartbeat says
            r.nodes.leave(other)
            assert r.nodes.all(timeout_s=timeout)[1].dead
        finally:
            stop[0] = 1
            beater.join()
        r.nodes.leave(me)


def test_evicted_owner_learns_on_heartbeat(region_path: str) -> None:
    _make(region_path, "sim")
    with Region.attach(region_path, backend="sim", sim_seed=1) as a, \
            Region.attach(region_path, backend="sim", sim_seed=2) as b:
        h = a.nodes.join(1)
        # another host (no shared OFD lock) judges node 1 dead and claims it
        from tract_async.region import nodes as nodes_mod
        os.close(h.lock_fd)
        h.lock_fd = -1
        time.sleep(0.15)
        h2 = b.nodes.join(1, timeout_s=0.1)
        with pytest.raises(E.NodeEvicted, match="taken over"):
            a.nodes.heartbeat(h)
        b.nodes.leave(h2)
        assert nodes_mod.NODE_LOCK_BASE > 1 << 39


def test_root_publication_across_processes(region_path: str, backend: str) -> None:
    _make(region_path, backend)
    q = SPAWN.Queue()
    with Region.attach(region_path, backend=backend, sim_seed=4) as r:
        # this node caches the empty directory first, so a missing invalidate would show
        with pytest.raises(E.RootNameNotFound):
            r.root.lookup("kv-index")
        p = SPAWN.Process(target=P.publish_root, args=(region_path, backend, "kv-index", 1 << 20, q))
        p.start()
        assert q.get(timeout=60)[0] == "published"
        p.join()
        e = r.root.lookup("kv-index")
        assert (e.offset_bytes, e.nbytes, e.kind) == (1 << 20, 4096, 3)
        p = SPAWN.Process(target=P.read_root, args=(region_path, backend, "kv-index", q))
        p.start()
        assert q.get(timeout=60) == ("found", 1 << 20, 3)
        p.join()
        with pytest.raises(E.RootNameInvalid):
            r.root.lookup("x" * 40)
        with pytest.raises(ValueError, match="already published"):
            r.root.publish("kv-index", 0, 1, holding_lock=True)


def test_remove(region_path: str) -> None:
    _make(region_path)
    remove(region_path)
    assert not os.path.exists(region_path)
    with pytest.raises(E.RegionNotFound):
        remove(region_path)
