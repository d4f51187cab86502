"""Worker processes for the cross-process engine tests (spawned; importable).

They move numpy arrays and never import torch (``engine_util`` says why: ~2 s of CPU per spawn).
"""
from __future__ import annotations

import asyncio
import faulthandler
import os
import random
import signal
import sys
import time

import numpy as np

import tract_async as tract
from tract_async import errors as E
from tests.support.engine_util import TINY, block_matches, cfg, kv_for_keys, np_out
from tract_async.keys import keys_to_words


def dumpable() -> None:
    """SIGUSR1 prints every thread's stack to stderr (pytest captures a spawned child's
    stderr with the test's): a parent that times out waiting for a report dumps the child
    before it kills it (``dump_and_kill``), so a hang names its place. A fatal signal
    (SIGSEGV, SIGABRT, ...) prints the stacks too."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def dump_and_kill(proc, wait_s: float = 2.0) -> None:  # noqa: ANN001
    """Ask a ``dumpable`` child for its stacks, give it ``wait_s`` to write them, kill it."""
    if proc is None:
        return
    if not proc.is_alive():
        print(f"dump_and_kill: {proc.name} (pid {proc.pid}) already exited, code "
              f"{proc.exitcode}", file=sys.stderr, flush=True)
        return
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(wait_s)
        proc.kill()
        proc.join(10)


def consumer(path: str, backend: str, node_id: int, token_ids: list[int], q_out, q_in) -> None:  # noqa: ANN001
    """Node 1: waits for blocks node 0 writes later: all layers, then layer by layer."""
    async def main() -> None:
        async with tract.Engine.open(cfg(path, node_id, backend=backend)) as eng:
            keys = eng.block_keys(token_ids)
            q_out.put(("ready", len(keys), 0))
            got = await eng.get_kv(keys, timeout=60.0, out=np_out(keys))  # produced later
            q_out.put(("all-layers", sum(block_matches(keys, got)), eng.lookup(keys)))
            keys2 = eng.block_keys([t + 7 for t in token_ids])
            for layer in range(TINY.num_layers):
                # the producer writes layer `layer` only after it hears we are waiting for it
                waiting = asyncio.create_task(eng.get_kv(keys2, layer=layer, timeout=60.0,
                                                         out=np_out(keys2, layer=layer)))
                await asyncio.sleep(0)
                q_out.put(("waiting", layer, eng.lookup(keys2)))
                got = await waiting
                q_out.put(("layer", layer, sum(block_matches(keys2, got, layer=layer))))
            st = eng.stats()
            q_out.put(("done", st["hits"], st["layer_waits"]))
            await asyncio.get_running_loop().run_in_executor(None, q_in.get)
    tract.run(main())


def stress_worker(path: str, backend: str, node_id: int, budget: float | int, universe: int,
                  validate: bool, seed: int, q_out, stop) -> None:  # noqa: ANN001
    """Put / get / (implicitly) evict random prompts; count every wrong byte seen. ``budget``:
    a float is seconds of wall time (the long forms), an int a count of operations (a put or a
    get: the CI form, the same work on a slow or loaded machine)."""
    import faulthandler
    import sys
    by_count = isinstance(budget, int)
    # a worker that outlives its budget by minutes prints every thread's stack (diagnosis)
    faulthandler.dump_traceback_later((150 if by_count else budget) + 150, exit=False,
                                      file=sys.stderr)

    async def main() -> dict:
        rnd = random.Random(seed)
        c = cfg(path, node_id, backend=backend, liveness_timeout_s=2.0)
        async with tract.Engine.open(c) as eng:
            eng._store.blocks.validate_reads = validate
            prompts = [eng.block_keys([p * 1000 + t for t in range(16 * (1 + p % 8))])
                       for p in range(universe)]
            res = {"puts": 0, "gets_ok": 0, "misses": 0, "wrong_blocks": 0, "full": 0}
            from tests.support.engine_util import kv_for_keys
            t_end = time.monotonic() + (0 if by_count else budget)
            ops = 0
            while (ops < budget if by_count else time.monotonic() < t_end) \
                    and not stop.is_set():
                ops += 1
                keys = prompts[rnd.randrange(universe)]
                if rnd.random() < 0.6 and eng.lookup(keys) < len(keys):
                    try:
                        await eng.put_kv(keys, kv_for_keys(keys, as_numpy=True))
                        res["puts"] += 1
                    except E.RegionFull:
                        res["full"] += 1
                    except E.TransferTimeout:
                        res["full"] += 1
                    continue
                try:
                    got = await eng.get_kv(keys, out=np_out(keys))
                except (E.BlockNotFound, E.BlockEvicted, E.LayerNotReady):
                    res["misses"] += 1
                    continue
                ok = block_matches(keys, got)
                res["gets_ok"] += 1
                res["wrong_blocks"] += ok.count(False)
                if not validate and res["wrong_blocks"]:
                    stop.set()           # the negative control has made its point
            st = eng.stats()
            res["evictions"] = st["evictions"]
            res["validation_failures"] = st["validation_failures"]
            res["lockfree_reservations"] = st["lockfree_reservations"]
            res["lock_acquisitions"] = st["lock_acquisitions"]
            res["evicting_nodes"] = int(st["evictions"] > 0)
            res["ops"] = ops
            return res
    try:
        q_out.put(("result", node_id, tract.run(main())))
    except BaseException as e:  # report, don't hang the parent
        q_out.put(("error", node_id, f"{type(e).__name__}: {e}"))
        raise


def kill_me_later(path: str, backend: str, node_id: int, q_out) -> None:  # noqa: ANN001
    """Joins, reports, then sleeps until killed."""
    async def main() -> None:
        async with tract.Engine.open(cfg(path, node_id, backend=backend)):
            q_out.put(("up", node_id, os.getpid()))
            await asyncio.sleep(600)
    tract.run(main())


def put_then_hang(path: str, backend: str, node_id: int, token_ids: list[int], create: bool,
                  q_out, region_kw: dict | None = None) -> None:  # noqa: ANN001
    """Creates (or joins) the region, stores the blocks of ``token_ids``, reports, then sleeps
    until killed: a node that dies holding chunks and index entries."""
    dumpable()

    async def main() -> None:
        c = cfg(path, node_id, create=create, backend=backend, **(region_kw or {}))
        async with tract.Engine.open(c) as eng:
            keys = eng.block_keys(token_ids)
            from tests.support.engine_util import kv_for_keys
            await eng.put_kv(keys, kv_for_keys(keys, as_numpy=True))
            q_out.put(("stored", node_id, eng.lookup(keys)))
            await asyncio.sleep(600)
    tract.run(main())


def layout_worker(path: str, backend: str, node_id: int, layout: tract.KVLayout, namespace: str,
                  token_ids: list[int], q_out, q_in) -> None:  # noqa: ANN001
    """Opens an engine of ``layout`` in ``namespace`` and stores the blocks of ``token_ids``
    (reports ``("stored", n, its namespace tag)``), or reports ``("refused", error type,
    message)``; stays open until told "bye" (a node's blocks leave with it)."""
    dumpable()

    async def main() -> None:
        try:
            eng = await tract.Engine.open(cfg(path, node_id, backend=backend, layout=layout,
                                              namespace=namespace))
        except E.TractError as e:
            q_out.put(("refused", type(e).__name__, str(e)))
            return
        try:
            keys = eng.block_keys(token_ids)
            n = await eng.put_kv(keys, kv_for_keys(keys, layout, as_numpy=True))
            q_out.put(("stored", n, eng._store.blocks.ns_tag))
            await asyncio.get_running_loop().run_in_executor(None, q_in.get, True, 120)
        finally:
            await eng.close()
    tract.run(main())


def reader_worker(path: str, backend: str, node_id: int, universe: int, seed: int, q_out,
                  stop, stale) -> None:  # noqa: ANN001
    """Gets random prompts of the disagreement stress until ``stop``; counts wrong bytes, and
    the misses that only the slot-tag check caught (entry intact, tag changed)."""
    async def main() -> dict:
        rnd = random.Random(seed)
        async with tract.Engine.open(cfg(path, node_id, backend=backend)) as eng:
            prompts = [eng.block_keys([p * 1000 + t for t in range(16 * (1 + p % 4))])
                       for p in range(universe)]
            res = {"gets_ok": 0, "misses": 0, "wrong_blocks": 0, "tag_misses": 0}
            q_out.put(("ready", node_id, None))
            while not stop.is_set():
                aim = stale.value
                keys = prompts[aim if aim >= 0 and rnd.random() < 0.5 else rnd.randrange(universe)]
                words = keys_to_words(keys)
                snap0 = eng._store.index.snapshot(words)
                try:
                    got = await eng.get_kv(keys, out=np_out(keys))
                except E.BlockEvicted:
                    res["misses"] += 1
                    snap1 = eng._store.index.snapshot(words)
                    # every entry unchanged across the whole get (same slot, version, READY):
                    # only the slot tag can have failed it
                    if ((snap0[:, 0] >= 0).all() and (snap0[:, 2] == 2).all()
                            and (snap0[:, :4] == snap1[:, :4]).all()):
                        res["tag_misses"] += 1
                    continue
                except (E.BlockNotFound, E.LayerNotReady):
                    res["misses"] += 1
                    await asyncio.sleep(0.001)
                    continue
                res["gets_ok"] += 1
                res["wrong_blocks"] += block_matches(keys, got).count(False)
            return res
    try:
        q_out.put(("result", node_id, tract.run(main())))
    except BaseException as e:  # report, don't hang the parent
        q_out.put(("error", node_id, f"{type(e).__name__}: {e}"))
        raise


def blocking_manager(path: str, backend: str, q_in, q_out) -> None:  # noqa: ANN001
    """Node 0: creates the region (and so manages the lock), then on "block" runs a blocking
    call of ``seconds`` on its event loop, as a worker's model step would."""
    async def main() -> None:
        async with tract.Engine.open(cfg(path, 0, create=True, backend=backend)) as eng:
            loop = asyncio.get_running_loop()
            while not eng.stats().get("is_lock_manager"):
                await asyncio.sleep(0.01)
            q_out.put(("manager", 0, os.getpid()))
            cmd, seconds = await loop.run_in_executor(None, q_in.get)
            assert cmd == "block"
            t0 = time.monotonic()
            time.sleep(seconds)                       # the loop is blocked: nothing else runs
            q_out.put(("unblocked", 0, time.monotonic() - t0))
            await loop.run_in_executor(None, q_in.get)
    tract.run(main())


def crash_worker(path: str, q_in, q_out, point: str | None = None) -> None:  # noqa: ANN001
    """Node 0 of the crash-point test (started with TRACT_CRASH_AT set, or given ``point``:
    a child forked from a warm server has the server's environment): stores its "before"
    blocks and reports them, then on "go" arms the crash point and runs every kind of step
    until it dies there --
    full and layer-wise puts, puts that evict, a cancelled large put (abandon), chunk claims,
    the takeover and grants of the manager role (node 2, the first manager, is killed before
    "go"), reclaim of node 2's chunks, and the chunk releases of close. Reports "not-reached"
    if it gets through all of it alive."""
    dumpable()
    from tract_async import crashpoints as CP
    from tests.support.engine_util import kv_for_keys

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with tract.Engine.open(cfg(path, 0, region_bytes=8 << 20, chunk_bytes=256 << 10)
                                     ) as eng:
            # the cancelled put's 1.5 MiB copy must run on a pool thread, where the cancel
            # lands mid-copy; on the loop's own thread (the default up to 8 MiB since
            # 2026-12-04, ``cpucopy.LOOP_SHARE_MAX_BYTES``) the put completes first
            eng._store.copier.loop_share = False
            before = eng.block_keys(range(7_000_000, 7_000_000 + 16 * 8))
            await eng.put_kv(before, kv_for_keys(before, as_numpy=True))
            q_out.put(("before", 0, len(before)))
            assert await loop.run_in_executor(None, q_in.get) == "go"
            # armed only now that the parent has the report: Queue.put hands it to a feeder
            # thread, and a background step (the pre-claim task's chunk claim) that hit the
            # point between arm() and the feeder's write lost it with the process (the parent
            # then waited for "before" in vain: a CI failure, reproduced under CPU hogs)
            CP.arm(point)
            for r in range(200):
                keys = eng.block_keys(range(r * 100_000, r * 100_000 + 16 * 4))
                kv = kv_for_keys(keys, as_numpy=True)
                if r % 3 == 1:                          # layer by layer
                    for layer in range(kv.shape[0]):
                        await eng.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer,
                                         timeout=10)
                else:
                    await eng.put_kv(keys, kv, timeout=10)
                if r % 5 == 2:                          # a large put cancelled mid-copy
                    big = eng.block_keys(range(50_000_000 + r * 10_000,
                                               50_000_000 + r * 10_000 + 16 * 48))
                    t = asyncio.create_task(eng.put_kv(big, kv_for_keys(big, as_numpy=True),
                                                       timeout=10))
                    for _ in range(10_000):
                        if eng._store.blocks.in_flight or t.done():
                            break
                        await asyncio.sleep(0)
                    t.cancel()
                    await asyncio.gather(t, return_exceptions=True)
                await asyncio.sleep(0.01)
        q_out.put(("not-reached", 0, None))        # the close above released chunks too

    try:
        tract.run(main())
    except BaseException as e:  # report, don't hang the parent
        q_out.put(("error", 0, f"{type(e).__name__}: {e}"))
        raise


def busy_loop_node(path: str, backend: str, node_id: int, token_ids: list[int], seconds: float,
                   mode: str, q_in, q_out) -> None:  # noqa: ANN001
    """Node ``node_id`` of the busy-loop lock tests: one get of the prompt, then on "go" a put
    of new blocks in another task (it must claim a chunk: it posts a lock request), one pause of
    0.3 s, then ``seconds`` in which its event loop runs nothing else:
    ``mode`` "gets" runs gets of the prompt back to back without any await of its own (fused
    hits never suspend), "block" one blocking call (a model step). "-no-yield" in it turns
    off the transfers' yield to the lock (``RegionStore.yield_to_lock``), "-no-handback" the
    lock's hand-back of a grant its busy loop cannot take (``PollPolicy.handback_s = 0``).
    Reports the gets and the lock acquisitions made during the busy time."""
    import dataclasses

    async def main() -> None:
        async with tract.Engine.open(cfg(path, node_id, backend=backend)) as eng:
            if "-no-yield" in mode:
                eng._store.yield_to_lock = False
            if "-no-handback" in mode:
                eng._lock.policy = dataclasses.replace(eng._lock.policy, handback_s=0.0)
            keys = eng.block_keys(token_ids)
            out = np_out(keys)
            assert block_matches(keys, await eng.get_kv(keys, out=out)) == [True] * len(keys)
            q_out.put(("ready", node_id, None))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, q_in.get) == "go"
            acq0 = eng.stats()["lock_acquisitions"]
            fresh = eng.block_keys([t + 1_000_000 for t in token_ids])
            putter = asyncio.create_task(eng.put_kv(fresh, kv_for_keys(fresh, as_numpy=True)))
            await asyncio.sleep(0.3)                   # the put waits for the lock meanwhile
            gets, t_end = 0, time.monotonic() + seconds
            if mode.startswith("block"):
                time.sleep(seconds)                    # the loop is blocked: nothing else runs
            else:
                while time.monotonic() < t_end:
                    await eng.get_kv(keys, out=out)
                    gets += 1
            await putter
            st = eng.stats()
            q_out.put(("done", node_id, (gets, st["lock_acquisitions"] - acq0, st["fused_gets"],
                                         st["lock"]["handbacks"])))
            assert await loop.run_in_executor(None, q_in.get) == "close"
    tract.run(main())


def paused_worker(path: str, q_in, q_out, point: str | None = None) -> None:  # noqa: ANN001
    """Node 0 of the paused-holder test (started with TRACT_CRASH_AT=<point> and
    TRACT_CRASH_ACTION=stop, or given ``point``: a child forked from a warm server has the
    server's environment, and then stops at ``point``): stores its "before" blocks and reports
    them; on "go" arms the point and puts and reads until it has stopped itself there once (SIGSTOP: a node paused,
    not dead) and was continued, then runs ``AFTER_ROUNDS`` more rounds. Every step that
    fails with a TractError is counted by type, not raised: a revoked or evicted node must
    refuse its writes cleanly, never corrupt or leak. Reads are checked byte for byte. Closes
    its engine (errors counted too) and reports ("done", {counts}, wrong blocks)."""
    dumpable()
    from tract_async import crashpoints as CP

    AFTER_ROUNDS = 6
    counts: dict[str, int] = {}
    wrong = 0

    def count(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1

    async def main() -> None:
        nonlocal wrong
        loop = asyncio.get_running_loop()
        eng = await tract.Engine.open(cfg(path, 0, region_bytes=8 << 20, chunk_bytes=256 << 10,
                                          preclaim_bytes=0))
        try:
            before = eng.block_keys(range(7_000_000, 7_000_000 + 16 * 8))
            await eng.put_kv(before, kv_for_keys(before, as_numpy=True))
            q_out.put(("before", 0, len(before)))
            assert await loop.run_in_executor(None, q_in.get) == "go"
            CP.arm(point, action="stop" if point is not None else None)
            after = 0
            for r in range(400):
                if CP.STOPPED:
                    after += 1
                    if after > AFTER_ROUNDS:
                        break
                keys = eng.block_keys(range(r * 100_000, r * 100_000 + 16 * 4))
                try:
                    await eng.put_kv(keys, kv_for_keys(keys, as_numpy=True), timeout=10)
                    count("put ok")
                except E.TractError as e:
                    count(f"put {type(e).__name__}")
                try:
                    got = await eng.get_kv(keys, out=np_out(keys))
                    wrong += sum(not ok for ok in block_matches(keys, got))
                    count("get ok")
                except E.TractError as e:
                    count(f"get {type(e).__name__}")
                await asyncio.sleep(0.005)
            count("stopped" if CP.STOPPED else "never stopped")
        finally:
            try:
                await eng.close()
                count("close ok")
            except (E.TractError, ExceptionGroup) as e:   # noqa: F821 - builtin in 3.11
                count(f"close {type(e).__name__}")
        q_out.put(("done", counts, wrong))

    try:
        tract.run(main())
    except BaseException as e:  # report, don't hang the parent
        q_out.put(("error", 0, f"{type(e).__name__}: {e}"))
        raise
