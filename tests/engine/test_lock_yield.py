"""A busy event loop must not hold the rack's global lock.

A grant is its waiter's only once the waiter's event loop runs again. Two ways a loop stays
busy while a task of it (here a put that claims a chunk, in another task of the process) has
been granted:

* a loop of small puts or gets: the fused kernels complete without suspending (the
  disagreement stress's LockTimeout: a reader's get loop held the rack's lock for 9 s). Each
  transfer yields one loop turn while a task of its process waits for or holds the lock
  (``stores/region.py``, "Yielding to this node's lock");
* a blocking call on the loop (a model step). The thread that sees the grant hands it back when
  the loop does not confirm within ``PollPolicy.handback_s`` (``sync/lock.py``, "Handing a
  grant back").

The hand-back also covers a loop of transfers without the yield. The negative controls switch
the defences off: node 0 then waits for the whole busy time.
"""
from __future__ import annotations

import asyncio
import time

import pytest

import tract_async as tract
import tract_kernels as K
from tract_async.sync import slots as S
from tests.support import procs_engine as P
from tests.support import warmproc
from tests.support.warmproc import forkserver_stopped_after_module  # noqa: F401  (autouse)
from tests.support.engine_util import TINY, cfg, kv_for_keys

SPAWN = warmproc.context()   # children fork warm (tests/support/warmproc)

BUSY_S = 3.0


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


@pytest.mark.parametrize("mode", ["gets", "gets-no-yield", "gets-no-yield-no-handback", "block",
                                  "block-no-handback"])
async def test_a_busy_loop_does_not_hold_the_racks_lock(region_path: str, mode: str) -> None:
    """``gets``: the yield lets the maintenance run inside the loop; ``gets-no-yield`` and
    ``block``: the grant is handed back; the ``-no-handback`` cases are the negative controls."""
    defended = "-no-handback" not in mode
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        tokens = list(range(4 * TINY.block_tokens))
        keys = eng.block_keys(tokens)
        await eng.put_kv(keys, kv_for_keys(keys))
        q_in, q_out = SPAWN.Queue(), SPAWN.Queue()
        p = SPAWN.Process(target=P.busy_loop_node,
                          args=(region_path, "hw", 1, tokens, BUSY_S, mode, q_in, q_out))
        p.start()
        try:
            assert (await _qget(q_out))[0] == "ready"
            lock = eng._lock
            await lock.acquire(timeout=30)
            try:
                q_in.put("go")
                # node 1 starts a put in another task (it asks for the lock, behind us),
                # pauses 0.3 s, then its loop is busy
                t_wait = time.monotonic() + 10
                while not _waiting(eng, 1):
                    assert time.monotonic() < t_wait, "node 1's put never asked for the lock"
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.6)          # node 1's loop is busy now
                assert _waiting(eng, 1)
            finally:
                lock.release()                    # the manager grants node 1 next
            t0 = time.monotonic()
            await lock.acquire(timeout=BUSY_S + 30)
            waited = time.monotonic() - t0
            lock.release()
            kind, node, (gets, acquired, fused, handbacks) = await _qget(q_out)
            assert (kind, node) == ("done", 1)
            print(f"{mode}: node 0 waited {waited:.3f} s for the lock node 1 was granted; node 1 "
                  f"made {gets} gets ({fused} fused), {acquired} lock acquisitions and "
                  f"{handbacks} hand-backs in its {BUSY_S} s busy time")
            if mode.startswith("gets"):
                assert gets > 100 and fused >= gets, "node 1's loop was not a loop of fused gets"
            if defended:
                assert waited < 0.5, f"node 0 waited {waited:.3f} s behind node 1's busy loop"
            else:
                # the granted put task of node 1 could only run when its loop was free
                assert waited > BUSY_S - 1.0, f"negative control: node 0 waited only {waited:.3f} s"
            if mode == "gets":
                assert acquired >= 1, "node 1's put never ran inside its loop"
            if mode in ("block", "gets-no-yield"):
                assert handbacks >= 1, "the grant was not handed back"
            if not defended:
                assert handbacks == 0
        finally:
            q_in.put("close")
            await asyncio.get_running_loop().run_in_executor(None, p.join, 30)
