"""A loop of small transfers must not hold the rack's global lock.

Small puts and gets (the fused kernels) complete without suspending. When a task of the same
loop (the engine's maintenance, flushing LRU touches) is granted the lock meanwhile, it cannot
run to release it until the caller's loop suspends: every other node's reservation waits for
the whole loop of transfers (the disagreement stress's LockTimeout: 9 s). Each transfer
therefore yields one loop turn while a task of its process waits for or holds the lock
(``stores/region.py``, "Yielding to this node's lock"); the negative control switches that off
and node 0 waits for the whole loop.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest

import tract_async as tract
import tract_kernels as K
from tract_async.sync import slots as S
from tests.support import procs_engine as P
from tests.support.engine_util import TINY, cfg, kv_for_keys

SPAWN = mp.get_context("spawn")
LOOP_S = 3.0


async def _qget(q, timeout: float = 120.0):  # noqa: ANN001, ANN202
    return await asyncio.get_running_loop().run_in_executor(None, q.get, True, timeout)


def _waiting(eng: tract.Engine, node_id: int) -> bool:
    """Node ``node_id`` has a request for lock 0 posted and not withdrawn (fresh read)."""
    region = eng._region
    geo = S.geometry(region)
    off = geo.req_off(0, node_id)
    req = int(K.load_fresh(region.mem, off + S.REQ_SEQ, S.S_STATE_READ))
    rel = int(K.load(region.mem, off + S.REL_SEQ))
    return req > rel


@pytest.mark.parametrize("yield_to_lock", [True, False], ids=["yields", "negative_control"])
async def test_a_loop_of_small_gets_does_not_hold_the_racks_lock(region_path: str,
                                                                   yield_to_lock: bool) -> None:
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        tokens = list(range(4 * TINY.block_tokens))
        keys = eng.block_keys(tokens)
        await eng.put_kv(keys, kv_for_keys(keys))
        q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
        p = SPAWN.Process(target=P.tight_get_loop,
                          args=(region_path, "hw", 1, tokens, LOOP_S, yield_to_lock, q_in, q_out))
        p.start()
        try:
            assert (await _qget(q_out))[0] == "ready"
            lock = eng._lock
            await lock.acquire(timeout=30)
            try:
                q_in.put("go")
                # node 1 touches the prompt, pauses 0.3 s (its maintenance asks for the lock,
                # behind us), then runs its loop of gets
                t_wait = time.monotonic() + 10
                while not _waiting(eng, 1):
                    assert time.monotonic() < t_wait, "node 1's maintenance never asked for the lock"
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.6)          # node 1 is inside its loop of gets now
                assert _waiting(eng, 1)
            finally:
                lock.release()                    # the manager grants node 1 next
            t0 = time.monotonic()
            await lock.acquire(timeout=LOOP_S + 30)
            waited = time.monotonic() - t0
            lock.release()
            kind, node, (gets, acquired, fused) = await _qget(q_out)
            assert (kind, node) == ("done", 1)
            print(f"yield_to_lock={yield_to_lock}: node 0 waited {waited:.3f} s for the lock "
                  f"node 1 was granted; node 1 made {gets} gets ({fused} fused) and "
                  f"{acquired} lock acquisitions in its {LOOP_S} s loop")
            assert gets > 100 and fused >= gets, "node 1's loop was not a loop of fused gets"
            if yield_to_lock:
                assert waited < 0.5, f"node 0 waited {waited:.3f} s behind node 1's loop"
                assert acquired >= 1, "node 1's maintenance never ran inside its loop"
            else:
                # the granted maintenance task of node 1 could only run when its loop ended
                assert waited > LOOP_S - 1.0, f"negative control: node 0 waited only {waited:.3f} s"
                assert acquired == 0
        finally:
            q_in.put("close")
            await asyncio.get_running_loop().run_in_executor(None, p.join, 30)
