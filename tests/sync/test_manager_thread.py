"""The lock manager keeps granting while its host's event loop is blocked (it runs on its own
thread and loop), and a manager that stops granting while its node stays live (a stalled
manager thread) loses its role to another node."""
from __future__ import annotations

import asyncio
import time

import pytest

import tract_async as tract
from tract_async.sync.manager import read_manager
from tests.support import procs_engine as P
from tests.support import warmproc
from tests.support.warmproc import forkserver_stopped_after_module  # noqa: F401  (autouse)
from tests.support.engine_util import block_matches, cfg, kv_for_keys

SPAWN = warmproc.context()   # children fork warm (tests/support/warmproc)



async def _qget(q, timeout: float = 120.0):  # noqa: ANN001, ANN202
    return await asyncio.get_running_loop().run_in_executor(None, q.get, True, timeout)


@pytest.mark.parametrize("backend", ["hw", "sim"])
async def test_other_nodes_keep_working_while_the_managers_loop_is_blocked(
        region_path: str, backend: str) -> None:
    q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
    p = SPAWN.Process(target=P.blocking_manager, args=(region_path, backend, q_in, q_out))
    p.start()
    try:
        assert (await _qget(q_out))[0] == "manager"
        async with tract.Engine.open(cfg(region_path, 1, backend=backend)) as eng:
            assert read_manager(eng._region).node_id == 0
            block_s = 6.0
            q_in.put(("block", block_s))
            await asyncio.sleep(0.5)                  # node 0's loop is now inside time.sleep
            done, t_end = 0, time.monotonic() + block_s - 1.5
            while time.monotonic() < t_end and done < 40:
                await asyncio.sleep(0.05)
                keys = eng.block_keys(range(done * 10_000, done * 10_000 + 32))
                # each put takes the global lock: granted by node 0's manager thread
                await eng.put_kv(keys, kv_for_keys(keys), timeout=2.0)
                assert all(block_matches(keys, await eng.get_kv(keys)))
                done += 1
            assert done >= 5, done
            assert read_manager(eng._region).node_id == 0, "no failover was needed"
            kind, _, blocked_s = await _qget(q_out)
            assert kind == "unblocked" and blocked_s >= block_s
            q_in.put(("bye", 0))
    finally:
        await asyncio.get_running_loop().run_in_executor(None, p.join, 60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


async def test_a_stalled_manager_thread_fails_over(region_path: str) -> None:
    """Node 0's manager thread stops (its heartbeat goes on): node 1 takes the role within a
    few liveness timeouts and grants; node 0's manager steps down when it resumes."""
    a = await tract.Engine.open(cfg(region_path, 0, create=True))
    b = await tract.Engine.open(cfg(region_path, 1))
    try:
        assert read_manager(a._region).node_id == 0
        stall = {"left": 1}

        def hook() -> None:
            if stall["left"]:
                stall["left"] = 0
                time.sleep(4.0)                       # the manager thread stops scanning
        a._manager.stall_hook = hook
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        keys = b.block_keys(range(32))
        await b.put_kv(keys, kv_for_keys(keys), timeout=8.0)
        took = time.monotonic() - t0
        info = read_manager(b._region)
        assert info.node_id == 1, info
        assert took < 4 * b.cfg.liveness_timeout_s, took
        assert all(block_matches(keys, await a.get_kv(keys)))
        deadline = time.monotonic() + 10
        while a._manager.statistics().stalls == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert a._manager.statistics().stalls == 1 and not a._manager.is_manager
        more = a.block_keys(range(1000, 1032))        # node 0's puts go through node 1's grants
        await a.put_kv(more, kv_for_keys(more), timeout=5.0)
        assert read_manager(a._region).node_id == 1
    finally:
        await b.close()
        await a.close()
