"""Worker processes of the engine-level kill -9 test (``tests/engine/test_kill_rack.py``).

Each is one node of a rack of engines on one region: it puts its own prompts and reads them
back, and reads its neighbours' latest prompts, every read checked byte for byte, until told
to stop; every operation's start and end (``time.monotonic``, one clock for all processes of
the host) go back to the parent, which kills nodes meanwhile and judges how long the
survivors' operations took from each kill. Numpy only (no torch: ``engine_util`` says why).
"""
from __future__ import annotations

import asyncio
import time

import tract_async as tract
from tract_async import errors as E
from tests.support.engine_util import block_matches, cfg, kv_for_keys, np_out
from tests.support.procs_engine import dumpable

BLOCKS = 4
"""Blocks per put: 128 KiB of the tiny layout, so that a node claims a 256 KiB chunk every
other put and takes the global lock often (the kill must find the lock busy)."""
STRIDE = 1_000_000
"""Token ids of node ``n``'s round ``r`` start at ``n * STRIDE * 10 + r * 1000``."""


def prompt(node_id: int, r: int) -> range:
    """The token ids of node ``node_id``'s round ``r`` (any node can name another's)."""
    base = node_id * STRIDE * 10 + r * 1000
    return range(base, base + 16 * BLOCKS)


def rack_node(path: str, node_id: int, nodes: int, region_kw: dict, q_out, go, stop,  # noqa: ANN001
              rounds) -> None:  # noqa: ANN001
    """Node ``node_id`` of ``nodes``: opens the engine, reports "ready", waits for ``go``,
    then works until ``stop``: round r puts prompt r (a put of fresh blocks), gets it back,
    and gets the latest prompt a neighbour published (``rounds[j]``: each node's last
    completed round, shared) without waiting -- a miss there is fine (the neighbour may be dead
    and its blocks dropped), other bytes are not. Reports ("done", node_id, {ops, wrong, misses, errors,
    stats}); ops are (kind, start, end). A TractError of any operation is recorded, not
    raised: the test asserts there are none."""
    dumpable()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        eng = await tract.Engine.open(cfg(path, node_id, **region_kw))
        ops: list[tuple[str, float, float]] = []
        errors: list[tuple[str, float, str]] = []
        wrong = misses = own_misses = 0
        try:
            q_out.put(("ready", node_id, None))
            await loop.run_in_executor(None, go.wait)
            r = 0
            while not stop.is_set():
                keys = eng.block_keys(prompt(node_id, r))
                t0 = time.monotonic()
                try:
                    await eng.put_kv(keys, kv_for_keys(keys, as_numpy=True), timeout=10)
                    ops.append(("put", t0, time.monotonic()))
                except E.TractError as e:
                    errors.append(("put", t0, f"{type(e).__name__}: {e}"))
                t0 = time.monotonic()
                try:
                    got = await eng.get_kv(keys, out=np_out(keys), timeout=10)
                    ops.append(("get", t0, time.monotonic()))
                    wrong += sum(not ok for ok in block_matches(keys, got))
                except (E.BlockNotFound, E.BlockEvicted):
                    ops.append(("get", t0, time.monotonic()))
                    own_misses += 1
                except E.TractError as e:
                    errors.append(("get", t0, f"{type(e).__name__}: {e}"))
                rounds[node_id] = r
                j = (node_id + 1 + r) % nodes
                if j != node_id and rounds[j] >= 0:
                    theirs = eng.block_keys(prompt(j, rounds[j]))
                    t0 = time.monotonic()
                    try:
                        # no timeout: a dead neighbour's dropped blocks are a miss at once
                        got = await eng.get_kv(theirs, out=np_out(theirs))
                        ops.append(("get-other", t0, time.monotonic()))
                        wrong += sum(not ok for ok in block_matches(theirs, got))
                    except (E.BlockNotFound, E.BlockEvicted, E.LayerNotReady):
                        ops.append(("get-other", t0, time.monotonic()))
                        misses += 1
                    except E.TractError as e:
                        errors.append(("get-other", t0, f"{type(e).__name__}: {e}"))
                r += 1
                await asyncio.sleep(0.002)
            st = eng.stats()
        finally:
            await eng.close()
        q_out.put(("done", node_id, {
            "ops": ops, "wrong": wrong, "misses": misses, "own_misses": own_misses,
            "errors": errors, "rounds": r,
            "evictions": st.get("evictions"), "lock": st.get("lock"),
            "is_lock_manager": st.get("is_lock_manager")}))

    try:
        tract.run(main())
    except BaseException as e:  # report, don't hang the parent
        q_out.put(("error", node_id, f"{type(e).__name__}: {e}"))
        raise
