"""Layouts are part of the region's contract (``region/namespaces.py``, ``stores/layouts.py``).

Node 0 stores blocks as TINY (4 layers, 2 KV heads: 32 KiB a block) in namespace "tiny"; its
keys are then handed to engines of other layouts. TWIN has TINY's block size with another
shape (2 layers, 4 heads): before the records, its get returned node 0's bytes as its own
tensor (the negative control below still does, with the check taken out). WIDE has twice the
block size: its get said ``BlockEvicted: ... changed during the read``. Both now raise
``LayoutMismatch`` naming both layouts, on every read path: the fused one (a few blocks), the
step-by-step one (more, whole or a layer, waiting or not) and the parallel groups. An engine
opened in namespace "tiny" with another layout is refused before it joins. The same layout in
two processes shares one record; the cross-process cases run on the incoherent sim backend too.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tract_async as tract
from tract_async import errors as E
from tract_async.region.namespaces import NamespaceTable
from tract_async.stores import fused
from tests.support import procs_engine as P
from tests.support import warmproc
from tests.support.warmproc import forkserver_stopped_after_module  # noqa: F401  (autouse)
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys, np_out

SPAWN = warmproc.context()   # children fork warm (tests/support/warmproc)

TWIN = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=4, head_dim=32, dtype="float32")
WIDE = tract.KVLayout(num_layers=8, block_tokens=16, kv_heads=2, head_dim=32, dtype="float32")
assert TWIN.block_bytes == TINY.block_bytes and WIDE.block_bytes == 2 * TINY.block_bytes


def _ids(first_block: int, n: int) -> list[int]:
    bt = TINY.block_tokens
    return list(range(first_block * bt, (first_block + n) * bt))


async def _stored(eng: tract.Engine, first_block: int, n: int) -> list[bytes]:
    keys = eng.block_keys(_ids(first_block, n))
    await eng.put_kv(keys, kv_for_keys(keys, as_numpy=True))
    return keys


def _names_both(msg: str, other: tract.KVLayout, other_ns: str) -> bool:
    return ("'tiny'" in msg and f"'{other_ns}'" in msg and "num_layers=4, " in msg
            and f"num_layers={other.num_layers}, " in msg)


@pytest.mark.parametrize("other", [TWIN, WIDE], ids=["same-block-size", "other-block-size"])
async def test_a_get_across_layouts_raises_layout_mismatch(region_path: str, backend: str,
                                                           other: tract.KVLayout) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as a, \
            tract.Engine.open(cfg(region_path, 1, backend=backend, layout=other,
                                  namespace="other")) as b:
        few, many = await _stored(a, 0, 4), await _stored(a, 100, 40)
        calls = [dict(keys=few, out=np_out(few, other)),                  # the fused read
                 dict(keys=many, out=np_out(many, other)),                # step by step
                 dict(keys=many, layer=1, out=np_out(many, other, layer=1)),
                 dict(keys=few, timeout=1.0, out=np_out(few, other))]     # a waiting read
        for kw in calls:
            with pytest.raises(E.LayoutMismatch) as got:
                await b.get_kv(**kw)
            assert _names_both(str(got.value), other, "other"), got.value
            assert not isinstance(got.value, E.BlockEvicted)
        assert b._store.stats.validation_failures == 0      # not counted as a torn read
        got = await a.get_kv(many, out=np_out(many))          # its own engine reads them
        assert all(block_matches(many, got))


async def test_without_the_check_a_get_returns_the_other_models_bytes(region_path: str) -> None:
    """The negative control: TWIN's engine with the namespace check taken out (tag 0, no
    guard: as before the records) gets node 0's bytes as a TWIN tensor, without an error."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a, \
            tract.Engine.open(cfg(region_path, 1, layout=TWIN, namespace="other")) as b:
        few, many = await _stored(a, 0, 4), await _stored(a, 100, 40)
        blk = b._store.blocks
        blk.layouts, blk.ns_tag, blk._fp[fused.P_NS_TAG] = None, 0, 0
        bt = TINY.block_tokens
        for keys in (few, many):
            got = await b.get_kv(keys, out=np_out(keys, TWIN))
            want = kv_for_keys(keys, as_numpy=True)
            for j in range(len(keys)):          # each block: TINY's bytes in TWIN's shape
                cut = slice(j * bt, (j + 1) * bt)
                assert got[:, :, cut].tobytes() == want[:, :, cut].tobytes()


async def test_parallel_groups_send_a_foreign_block_to_the_checked_read(region_path: str
                                                                        ) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, copy_threads=2)) as a, \
            tract.Engine.open(cfg(region_path, 1, layout=TWIN, namespace="other",
                                  copy_threads=2)) as b:
        keys = await _stored(a, 0, 96)                        # 3 MiB: the parallel path
        with pytest.raises(E.LayoutMismatch):
            await b.get_kv(keys, out=np_out(keys, TWIN))
        st = b._store.stats
        assert st.parallel_reads_redone == 1 and st.parallel_reads == 0


async def test_an_open_with_another_layout_than_its_namespace_recorded_is_refused(
        region_path: str, backend: str) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as a:
        for other in (TWIN, WIDE):
            with pytest.raises(E.LayoutMismatch) as got:
                await tract.Engine.open(cfg(region_path, 1, backend=backend, layout=other))
            msg = str(got.value)
            assert "num_layers=4, " in msg and f"num_layers={other.num_layers}, " in msg, msg
            assert "EngineConfig.namespace" in msg
        assert a.region.nodes.live_ids() == [0]            # refused before it joined
        keys = await _stored(a, 0, 4)
        assert all(block_matches(keys, await a.get_kv(keys, out=np_out(keys))))
        async with tract.Engine.open(cfg(region_path, 1, backend=backend, layout=TWIN,
                                         namespace="twin")) as b:
            assert b._store.blocks.ns_tag == 2         # another namespace: its own record
        recs = NamespaceTable.of(a.region).records()
        assert [(r.layout.name, r.layout.num_layers, r.recorded_by) for r in recs] == \
            [("tiny", 4, 0), ("twin", 2, 1)]
        from tract_async.cli import inspect_text
        shown = inspect_text(region_path, backend=backend)
        assert "1   namespace 'tiny': KVLayout(num_layers=4, " in shown
        assert "2   namespace 'twin': KVLayout(num_layers=2, " in shown


async def test_the_same_layout_in_another_namespace_reads_as_is(region_path: str) -> None:
    """Blocks of a namespace of the same layout have this engine's shape: read, and the
    foreign record is remembered (only keys handed over reach them: keys fold the namespace)."""
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as a, \
            tract.Engine.open(cfg(region_path, 1, namespace="copy")) as b:
        keys = await _stored(a, 0, 12)
        assert b.block_keys(_ids(0, 12)) != keys            # the namespace is in the keys
        got = await b.get_kv(keys, out=np_out(keys))
        assert all(block_matches(keys, got))
        assert b._store.blocks.layouts.readable == {0, 1, 2}


async def _qget(q, timeout: float = 120.0):  # noqa: ANN001, ANN202
    return await asyncio.get_running_loop().run_in_executor(None, q.get, True, timeout)


async def test_the_same_layout_in_two_processes_shares_one_record(region_path: str,
                                                                  backend: str) -> None:
    q_out, q_in = SPAWN.Queue(), SPAWN.Queue()
    ids = _ids(0, 6)
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as a:
        p = SPAWN.Process(target=P.layout_worker,
                          args=(region_path, backend, 1, TINY, "tiny", ids, q_out, q_in))
        p.start()
        try:
            kind, n, tag = await _qget(q_out)
            assert (kind, n, tag) == ("stored", 6, a._store.blocks.ns_tag) and tag == 1
            keys = a.block_keys(ids)
            assert all(block_matches(keys, await a.get_kv(keys, out=np_out(keys))))
            q_in.put("bye")
        finally:
            await asyncio.get_running_loop().run_in_executor(None, p.join, 60)
            if p.is_alive():
                p.kill()
        assert p.exitcode == 0
        assert len(NamespaceTable.of(a.region).records()) == 1


async def test_a_process_with_another_layout_is_refused(region_path: str, backend: str) -> None:
    q_out, q_in = SPAWN.Queue(), SPAWN.Queue()
    async with tract.Engine.open(cfg(region_path, 0, create=True, backend=backend)) as a:
        p = SPAWN.Process(target=P.layout_worker,
                          args=(region_path, backend, 1, TWIN, "tiny", _ids(0, 6), q_out, q_in))
        p.start()
        try:
            kind, name, msg = await _qget(q_out)
            assert (kind, name) == ("refused", "LayoutMismatch"), msg
            assert "num_layers=2, " in msg and "num_layers=4, " in msg
        finally:
            await asyncio.get_running_loop().run_in_executor(None, p.join, 60)
            if p.is_alive():
                p.kill()
        assert p.exitcode == 0 and a.region.nodes.live_ids() == [0]
        assert np.array_equal([r.tag for r in NamespaceTable.of(a.region).records()], [1])
