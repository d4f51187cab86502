"""The soak: real processes doing random puts, gets, lookups and evictions on one region under
the incoherent backend, while a supervisor kills them (-9) and restarts them.

It finishes with three verdicts: zero wrong bytes (every get is bit-exact or a miss), zero fsck
findings once everyone has closed, and bounded memory (each worker's RSS growth after its first
report). ``tests/engine/test_soak.py`` runs it for CI bounded by counts (``kills``), and for
``TRACT_SOAK_S`` (default 120 s) under the ``slow`` marker, and
``bench/soak.py`` for an hour, printing operations, kills and wrong bytes.

Workers are node ids 1..``workers``; a killed one is restarted under the same id once its old
incarnation is judged dead (a liveness timeout later). Each incarnation reports on a pipe of its
own: a process killed while writing to a shared ``multiprocessing.Queue`` keeps that queue's
write lock forever, after which no other worker's report arrives and every worker hangs at exit
flushing its queue (the soak then stopped counting after ~50 kills, and CI once hit its 600 s
limit). Block contents are a pure function of
the key (``kv_of``), so any process can check any block it reads. Workers move numpy arrays and
never import torch (a restarted worker would pay ~2 s of CPU for it on a 2-core VM).
"""
from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import resource
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

SPAWN = mp.get_context("spawn")


def layout() -> Any:
    import tract_async as tract
    return tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=32,
                          dtype="float32")


def config(path: str, node_id: int, *, create: bool = False, liveness_s: float = 1.0) -> Any:
    import tract_async as tract
    return tract.EngineConfig(layout=layout(), region=path, region_bytes=8 << 20, create=create,
                              node_id=node_id, max_nodes=8, namespace="soak", mem_backend="sim",
                              heartbeat_interval_s=0.05, liveness_timeout_s=liveness_s,
                              chunk_bytes=256 << 10)


def kv_of(keys: list[bytes], lay: Any) -> np.ndarray:
    """KV whose every block is a pure function of its key (float32, a numpy array)."""
    out = []
    for k in keys:
        g = np.random.default_rng(int.from_bytes(hashlib.sha256(k).digest()[:8], "little"))
        out.append(g.standard_normal(
            (lay.num_layers, 2, lay.block_tokens, lay.kv_heads, lay.head_dim)).astype(np.float32))
    return np.concatenate(out, axis=2)


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def worker(path: str, node_id: int, seed: int, q: Any, stop: Any, liveness_s: float) -> None:
    """One soak node: random operations until ``stop``; reports counters every second on ``q``
    (this incarnation's pipe end, or anything with ``send``)."""
    import tract_async as tract
    from tract_async import errors as E

    async def main() -> None:
        rnd = random.Random(seed)
        lay = layout()
        T = lay.block_tokens
        async with tract.Engine.open(config(path, node_id, liveness_s=liveness_s)) as eng:
            prompts = [eng.block_keys([p * 1000 + t for t in range(T * (1 + p % 6))])
                       for p in range(64)]
            c = {"puts": 0, "layer_puts": 0, "gets": 0, "exact": 0, "misses": 0, "wrong": 0,
                 "lookups": 0, "evicts": 0, "full": 0, "ops": 0}
            last = time.monotonic()
            first_rss = _rss_kib()
            while not stop.is_set():
                keys = prompts[rnd.randrange(len(prompts))]
                op = rnd.random()
                c["ops"] += 1
                try:
                    if op < 0.35:
                        if eng.lookup(keys) < len(keys):
                            await eng.put_kv(keys, kv_of(keys, lay), timeout=10)
                            c["puts"] += 1
                    elif op < 0.45:
                        kv = kv_of(keys, lay)
                        for layer in range(lay.num_layers):
                            await eng.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer,
                                             timeout=10)
                        c["layer_puts"] += 1
                    elif op < 0.85:
                        c["gets"] += 1
                        try:
                            got = await eng.get_kv(keys, timeout=0.05 if op < 0.5 else None,
                                                   out=np.empty(lay.kv_shape(len(keys)),
                                                                dtype=np.float32))
                        except (E.BlockNotFound, E.BlockEvicted, E.LayerNotReady,
                                E.TransferTimeout):
                            c["misses"] += 1
                        else:
                            want = kv_of(keys, lay)
                            for j in range(len(keys)):
                                ok = np.array_equal(got[:, :, j * T:(j + 1) * T],
                                                    want[:, :, j * T:(j + 1) * T])
                                c["exact" if ok else "wrong"] += 1
                    elif op < 0.95:
                        eng.lookup(keys)
                        c["lookups"] += 1
                    else:
                        c["evicts"] += await eng.parts.store.blocks.evict(keys, timeout=10)
                except (E.RegionFull, E.TransferTimeout):
                    c["full"] += 1
                now = time.monotonic()
                if now - last >= 1.0:
                    q.send(("stats", node_id, dict(c), first_rss, _rss_kib()))
                    last = now
                await asyncio.sleep(0)
            q.send(("stats", node_id, dict(c), first_rss, _rss_kib()))
        q.send(("closed", node_id, None, 0, 0))

    try:
        tract.run(main())
    except BaseException as e:  # report, don't hang the supervisor
        q.send(("error", node_id, f"{type(e).__name__}: {e}", 0, 0))
        raise


class StopFlag:
    """A stop signal for processes that get killed with -9: one shared byte, no lock.

    ``multiprocessing.Event`` guards its flag with a semaphore. A worker killed inside
    ``is_set()`` held it forever: every later ``is_set()`` of a restarted worker and the
    supervisor's ``set()`` then blocked for good (the hour soak stopped making progress after
    ~350 kills and its supervisor hung in ``set()``, py-spy showed; likely the CI soak's 600 s
    timeout too). One byte written by one process and read by others needs no lock."""

    def __init__(self) -> None:
        self._v = SPAWN.RawValue("b", 0)

    def set(self) -> None:
        self._v.value = 1

    def is_set(self) -> bool:
        return bool(self._v.value)


@dataclass(kw_only=True)
class SoakResult:
    seconds: float
    workers: int
    kills: int = 0
    restarts: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    rss_growth_kib: dict[int, int] = field(default_factory=dict)
    fsck_problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run(path: str, seconds: float, *, workers: int = 3, kill_every_s: float = 6.0,
        liveness_s: float = 1.0, seed: int = 0, progress: Any = None, kills: int | None = None,
        ops_per_kill: int = 200, mp_context: BaseContext | None = None) -> SoakResult:
    """Create the region, run the soak for ``seconds``, stop everyone, fsck. The region file
    is left for the caller to remove.

    ``kills``: bounded by counts instead (CI: the same work on a slow or loaded machine): a
    worker is killed each time every worker is up and its incarnation has done
    ``ops_per_kill`` operations (a restarted one's first operations meet its predecessor's
    leftovers), and the soak stops once ``kills`` kills are done and every worker is up again
    with ``ops_per_kill`` operations of its own; ``seconds`` is then only a limit, and reaching
    it is an error (``SoakResult.errors``). ``kill_every_s`` applies only to the timed form.

    ``mp_context``: how workers start (default ``spawn``: a fresh interpreter that imports the
    package and loads the kernels, ~1-2 s on a 2-core VM). The CI form passes a forkserver
    whose preload did that once (``tests/support/warmproc.py``): each of its seven starts is
    then a fork. A worker reads no per-start setting from the environment (a forkserver child
    has the server's)."""
    import tract_async as tract
    from tract_async.tools.fsck import run_fsck

    async def create() -> None:
        async with tract.Engine.open(config(path, 0, create=True, liveness_s=liveness_s)):
            pass
    tract.run(create())
    rnd = random.Random(seed)
    stop = StopFlag()
    procs: dict[int, Any] = {}
    conns: dict[int, Any] = {}          # node -> the read end of its incarnation's pipe
    # per incarnation: the last counters it reported (a killed one's count as they were)
    done: list[dict[str, int]] = []
    latest: dict[int, dict[str, int]] = {}
    res = SoakResult(seconds=seconds, workers=workers)

    ctx = mp_context if mp_context is not None else SPAWN

    def start(n: int) -> None:
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker, args=(path, n, rnd.randrange(1 << 30), w, stop,
                                               liveness_s))
        p.start()
        w.close()                       # the child holds the write end
        procs[n], conns[n] = p, r
        latest[n] = {}

    def take(n: int, msg: Any) -> None:
        kind, _node, data, rss0, rss = msg
        if kind == "stats":
            latest[n] = data
            res.rss_growth_kib[n] = max(res.rss_growth_kib.get(n, 0), rss - rss0)
        elif kind == "error":
            res.errors.append(f"node {n}: {data}")

    def read_all(n: int) -> None:
        """Everything complete on node ``n``'s pipe; the pipe is dropped at its end (EOF, or a
        message cut short by a kill)."""
        c = conns.get(n)
        while c is not None:
            try:
                if not c.poll():
                    return
                take(n, c.recv())
            except Exception:  # noqa: BLE001 - EOF, or a message cut short (unpickling fails)
                c.close()
                conns.pop(n, None)
                return

    def drain(timeout: float = 0.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ready = mpc.wait(list(conns.values()), timeout=max(0.0, deadline - time.monotonic()))
            by_conn = {id(c): n for n, c in conns.items()}
            for c in ready:
                read_all(by_conn[id(c)])
            if time.monotonic() >= deadline:
                return

    def all_busy() -> bool:
        """Every worker up, its incarnation past ``ops_per_kill`` operations (count form)."""
        return not pending_restart and all(latest.get(n, {}).get("ops", 0) >= ops_per_kill
                                           for n in procs)

    for n in range(1, workers + 1):
        start(n)
    t_end = time.monotonic() + seconds
    next_kill = time.monotonic() + kill_every_s
    pending_restart: dict[int, float] = {}
    while time.monotonic() < t_end:
        drain(0.2)
        now = time.monotonic()
        for n, at in list(pending_restart.items()):
            if now >= at:
                del pending_restart[n]
                start(n)
                res.restarts += 1
        if kills is not None and res.kills >= kills and all_busy():
            break
        if (now >= next_kill) if kills is None else (res.kills < kills and all_busy()):
            alive = [n for n, p in procs.items() if p.is_alive() and n not in pending_restart]
            if alive:
                n = rnd.choice(alive)
                os.kill(procs[n].pid, signal.SIGKILL)
                procs[n].join(10)
                res.kills += 1
                read_all(n)                 # what it sent before it died, then drop the pipe
                if n in conns:
                    conns.pop(n).close()
                done.append(latest.pop(n, {}))
                pending_restart[n] = now + liveness_s * 2.5    # its old self must read as dead
            next_kill = now + kill_every_s
        if progress is not None:
            progress(res, latest, now)
    else:
        if kills is not None:
            res.errors.append(f"{res.kills} of {kills} kills (ops per kill {ops_per_kill}) "
                              f"within the {seconds:.0f} s limit")
    stop.set()
    # Keep reading while the workers stop: a worker blocked on a full pipe would never exit.
    deadline = time.monotonic() + 60
    while any(p.is_alive() for p in procs.values()) and time.monotonic() < deadline:
        drain(0.1)
    for n in list(conns):
        read_all(n)
    for n, p in procs.items():
        if p.is_alive():
            p.kill()
            p.join(10)
            res.errors.append(f"node {n} did not stop within 60 s")
        p.join()
    drain(0.5)
    for c in done + list(latest.values()):
        for k, v in c.items():
            res.ops[k] = res.ops.get(k, 0) + v
    res.wrong = res.ops.get("wrong", 0)
    # the chunks of killed incarnations wait for the next claim's recovery: run it once, as
    # any node would (Engine.recover), then fsck must find nothing at all
    time.sleep(liveness_s * 1.5)

    async def recover() -> None:
        async with tract.Engine.open(config(path, 0, liveness_s=liveness_s)) as eng:
            await asyncio.sleep(liveness_s)     # own beats: the dead verdict needs them
            await eng.recover()
    tract.run(recover())
    res.fsck_problems = list(run_fsck(path, liveness_timeout_s=liveness_s).problems)
    return res
