"""Compile every jitted path once, so that later processes load machine code from the cache.

Numba compiles on first call (seconds per function family on a cold cache). A rack of freshly
started processes that all compile at once on a small machine can miss its own heartbeats and
lock deadlines while it does. ``python -m tract_async.tools.warmup`` (or ``warm_up()``) runs a short
scenario that exercises the kernels, the index, the waits, the lock and its manager, the
allocator and fsck on a throw-away region in ``/dev/shm``, on both memory backends, and removes
the region. With ``NUMBA_CACHE_DIR`` set, everything after it starts warm.

A cold cache is otherwise silent for tens of seconds (the first ``tract demo`` sat 41 s without
a word): ``Engine.open`` runs this scenario itself, in a child process, before its node joins,
where no stamp says this build was warmed into the cache (``kernel_cache``, which also holds
the cache state, the notice and the compile watcher; their names are re-exported here).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import numpy as np

from tract_async import arrays
from tract_async.kernel_cache import (CacheState, cache_state, compiles_after_warmup,
                                      ensure_warm, notice_if_cold, preload, scenario_running,
                                      stamp_path)

__all__ = ["CacheState", "cache_state", "compiles_after_warmup", "ensure_warm", "notice_if_cold",
           "preload", "stamp_path", "warm_up", "main"]

WARMUP_LIVENESS_S = 120.0
"""The liveness timeout of the scenario's throw-away engines. Their own lock manager runs while
the scenario compiles (seconds per kernel family, with the GIL and Numba's compiler lock held),
so a rack-like timeout would make it step down, as the cold demo's did with 10 s (stall 6.6 s);
nothing else shares their region, so a long timeout costs nothing."""


async def _scenario_at(path: str, backend: str) -> None:
    """The scenario on a throw-away region at ``path``, removed afterwards."""
    from tract_async.region.region import discard
    try:
        with scenario_running():
            await _scenario(path, backend)
            for sub, fn in (("window", _window_scenario), ("large", _large_read_scenario)):
                try:
                    await fn(f"{path}-{sub}", backend)
                finally:
                    discard(f"{path}-{sub}")
    finally:
        discard(path)


async def _scenario(path: str, backend: str) -> None:
    import tract_async as tract
    from tract_async.stores import doorbell as db
    from tract_async.stores import waits
    from tract_async.region import index as ix
    from tract_async.keys import keys_to_words
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=1, head_dim=32,
                            dtype="float32")
    rng = np.random.default_rng(0)     # numpy arrays: the warm-up needs no torch (arrays.py)

    def randn(n: int) -> np.ndarray:
        return rng.standard_normal(layout.kv_shape(n), dtype=np.float32)
    common = dict(layout=layout, region=path, region_bytes=8 << 20, max_nodes=4,
                  namespace="warmup", mem_backend=backend, heartbeat_interval_s=0.05,
                  liveness_timeout_s=WARMUP_LIVENESS_S)
    # two copy threads on the hardware backend: the large put and get below then run on the
    # copy gang (``stores/copygang.py``), whose kernels a host with one copy thread (a 2-core
    # VM) would otherwise never compile -- and every Engine.open would say they are cold
    threads = 2 if backend == "hw" else None
    a = await tract.Engine.open(tract.EngineConfig(**common, create=True, node_id=0,
                                                   copy_threads=threads))
    b = await tract.Engine.open(tract.EngineConfig(**common, node_id=1))
    try:
        keys = a.block_keys(range(48))
        kv = randn(len(keys))
        # the wait paths; a generous deadline: on a cold cache the puts below compile first
        # (every get with ``out``: without one a get returns a torch tensor where torch is
        # installed, and .ci/run installs torch while this runs: nothing here may import it)
        waiter = asyncio.create_task(b.get_kv(keys, out=np.empty_like(kv[1]), layer=1,
                                              timeout=600))
        for layer in range(layout.num_layers):
            await a.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
        await waiter
        for layer in range(layout.num_layers):      # later layers take the known slots
            await b.get_kv(keys, out=np.empty_like(kv[layer]), layer=layer)
        got = np.empty_like(kv)
        await b.get_kv(keys, out=got)
        assert np.array_equal(got, kv)
        b.lookup(keys)
        one = a.block_keys(range(2000, 2016))      # the 1-block fast paths (scalar publish)
        await a.put_kv(one, randn(1))
        await b.get_kv(one, out=np.empty(layout.kv_shape(1), dtype=np.float32))
        more = a.block_keys(range(1000, 1064))
        await a.put_kv(more, randn(len(more)))
        big = a.block_keys(range(100_000, 100_000 + 16 * 320))    # 2.5 MiB: cut in two
        big_kv = randn(len(big))
        await a.put_kv(big, big_kv)
        big_got = np.empty_like(big_kv)
        await a.get_kv(big, out=big_got)
        assert np.array_equal(big_got, big_kv)
        await a.parts.store.maintain(timeout=10)
        # a reservation's look at other nodes' chunk asks (stores/chunkgive.py): it runs only
        # for a node owning two chunks or more, once per 50 ms, so a scenario may never get there
        a.parts.store.alloc.table.asks_other_than(0)
        st = b.parts.store
        stop = np.zeros(1, dtype=np.uint8)
        waits.poll_ready(st.mem, st.geo.entries_offset, st.index.mask, st.geo.max_probe,
                         st.geo.lanes, np.zeros((1, 4), dtype=np.uint64), 0, np.uint64(1), True, 0, stop,
                         np.zeros((1, 8), dtype=np.int64))
        waits.poll_present(st.mem, st.geo.entries_offset, st.index.mask, st.geo.max_probe,
                           st.geo.lanes, np.zeros((1, 4), dtype=np.uint64), 0, stop)
        bell = st.blocks.doorbell           # the producer's look on its own (tests call it)
        db.waiting_mask(st.mem, bell.offset, bell.max_nodes)
        ix.scan_entries(st.mem, st.geo.entries_offset, st.geo.capacity,
                        np.zeros((st.geo.capacity, 9), dtype=np.int64))
        st.index.expired_transfer(0)                # transfer-mode maintenance's pass
        # a device read's invalidation of the lines this host's CPU read (cuda/store.py,
        # ``invalidate_for_dma``: the CPU marks, then the line drops; no CUDA call), of a layer
        # and of whole blocks: a GPU host's first device read compiled them after the warm-up
        from tract_async.cuda.store import invalidate_for_dma
        bl = st.blocks
        poffs = st.index.snapshot(keys_to_words(keys))[:, ix.SNAP_POFF]
        await invalidate_for_dma(bl, poffs, 0)
        await b.get_kv(keys, out=np.empty_like(kv))             # marks them again
        await invalidate_for_dma(bl, poffs, None)
        # transfer mode's layer-streamed reads (a decode worker's): the known-slot path and
        # its layer refresh, which a cache-mode read of these sizes never takes (the cold
        # demo's decode worker compiled rows_fine and refresh_layers_batch[_held] after the
        # warm-up until this was here)
        # (blocks of 32 KiB: smaller layer reads take the fused path, which has its own kernels)
        tlayout = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=32,
                                 dtype="float32")
        tcommon = {**common, "layout": tlayout, "namespace": "warmup-t", "mode": "transfer",
                   "defer_consume": True}
        c = await tract.Engine.open(tract.EngineConfig(**tcommon, node_id=2))
        d = await tract.Engine.open(tract.EngineConfig(**tcommon, node_id=3))
        try:
            tkeys = c.block_keys(range(16 * 40), extra_keys=("warmup",))
            tkv = rng.standard_normal(tlayout.kv_shape(len(tkeys)), dtype=np.float32)
            reader = asyncio.create_task(_read_layers(d, tkeys, tlayout.num_layers))
            for layer in range(tlayout.num_layers):
                await c.put_kv(tkeys, np.ascontiguousarray(tkv[layer]), layer=layer)
            await reader
            # the reader's frees of the producer's slots go through the return rings (a push
            # each, region/alloc.py), which the producer's maintenance then drains
            await d.parts.store.blocks.drain_consumed()
            await c.parts.store.maintain(timeout=10)
        finally:
            await d.close()
            await c.close()
    finally:
        await b.close()
        await a.close()
    # the CUDA direct path's host-side planners (no CUDA call): a GPU host's first put would
    # compile them after the warm-up; a put's offsets are contiguous (its batch's array), a
    # get's a column of its snapshot (strided: another signature)
    from tract_async.cuda import direct
    direct.template(layout, np.arange(3, dtype=np.int64) * layout.block_bytes, False, 0)
    direct.template(layout, (np.arange(6, dtype=np.int64) * layout.block_bytes)[::2], False, 0)
    from tract_async.tools.fsck import run_fsck
    run_fsck(path, backend=backend)


async def _window_scenario(path: str, backend: str) -> None:
    """A node that fills its lane of a small index: its puts evict its own oldest entries of
    a full probe window (``index.evict_window_batch``), which the main scenario's index, sized
    for its region, never fills."""
    import tract_async as tract
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=1, head_dim=32,
                            dtype="float32")
    rng = np.random.default_rng(1)
    e = await tract.Engine.open(tract.EngineConfig(
        layout=layout, region=path, region_bytes=32 << 20, max_nodes=8, namespace="warmup-w",
        mem_backend=backend, create=True, node_id=0, index_capacity=256, chunk_bytes=1 << 20,
        heartbeat_interval_s=0.05, liveness_timeout_s=WARMUP_LIVENESS_S))
    try:
        for r in range(24):                  # 24 x 8 blocks into a lane of 32 entries
            keys = e.block_keys(range(r * 10_000, r * 10_000 + 16 * 8))
            await e.put_kv(keys, rng.standard_normal(layout.kv_shape(len(keys)),
                                                     dtype=np.float32))
        if e.stats()["evictions_for_space"] == 0:
            raise RuntimeError("warm-up: the small index's window never filled")
    finally:
        await e.close()


async def _large_read_scenario(path: str, backend: str) -> None:
    """Gets of at least ``routing.NT_READ_BYTES`` (non-temporal stores into the output,
    ``index.copy_out_nt``), and the same on the older read-ahead pair (``copy_read_ahead``:
    ``drop_payload_rows_ahead`` and ``copy_out_behind``), which the main scenario's 8 MiB
    region cannot hold."""
    import tract_async as tract
    from tract_async.stores import routing as R
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=4, head_dim=64,
                            dtype="float32")             # 64 KiB blocks
    n = R.NT_READ_BYTES // layout.block_bytes + 16
    common = dict(layout=layout, region=path, region_bytes=4 * n * layout.block_bytes,
                  max_nodes=4, namespace="warmup-l", mem_backend=backend,
                  heartbeat_interval_s=0.05, liveness_timeout_s=WARMUP_LIVENESS_S)
    threads = 2 if backend == "hw" else None     # as the main scenario's first engine
    x = await tract.Engine.open(tract.EngineConfig(**common, create=True, node_id=0,
                                                   copy_threads=threads))
    y = await tract.Engine.open(tract.EngineConfig(**common, node_id=1, copy_threads=threads,
                                                   copy_read_ahead=True))
    try:
        keys = x.block_keys(range(16 * n))
        kv = np.random.default_rng(2).standard_normal(layout.kv_shape(n), dtype=np.float32)
        await x.put_kv(keys, kv)
        for e in (x, y):
            got = np.empty_like(kv)
            await e.get_kv(keys, out=got)
            if not np.array_equal(got, kv):
                raise RuntimeError("warm-up: a large read returned other bytes")
    finally:
        await y.close()
        await x.close()


async def _read_layers(engine: object, keys: list[bytes], num_layers: int) -> None:
    """A decode worker's reads: every layer in order, each waiting for its publication."""
    layout = engine.layout  # type: ignore[attr-defined]
    for layer in range(num_layers):    # into numpy arrays: no torch (_scenario_at says why)
        out = np.empty(layout.kv_shape(len(keys), layer),
                       dtype=arrays.NUMPY_STORAGE[layout.dtype_name])
        await engine.get_kv(keys, out=out, layer=layer, timeout=600)  # type: ignore[attr-defined]


def warm_up(*, backends: tuple[str, ...] = ("hw", "sim"), verbose: bool = False,
            stamp: str | None = None, jobs: int | None = None) -> float:
    """Run the scenario on each backend and stamp the cache (``stamp_path``), so that a later
    ``Engine.open`` only loads; returns the seconds it took. ``verbose``: the cold cache notice
    (if cold) and one line per backend on stdout. ``stamp``: write this file instead (one
    backend only: the path ``kernel_cache.ensure_warm`` waits for). ``jobs``: processes for a
    cold cache (default ``precompile.jobs()``: 2 on two or more CPUs): a helper compiles the
    scenario's known kernels from the other end (``tools/precompile.py``), and the scenario
    runs once more once it ended, before any stamp is written."""
    if stamp is not None and len(backends) != 1:
        raise ValueError(f"warm_up: one stamp for {len(backends)} backends")
    from tract_async.engine import run
    from tract_async.tools import precompile
    if verbose:
        notice_if_cold()
    t0 = time.perf_counter()
    helper = None
    stamps = [stamp] if stamp is not None else [stamp_path(b) for b in backends]
    if (jobs if jobs is not None else precompile.jobs()) > 1 and not all(
            p is not None and os.path.exists(p) for p in stamps):
        helper = precompile.start_helper()
    took: dict[str, float] = {}

    def scenario(backend: str, what: str = "") -> None:
        path = f"/dev/shm/tract-warmup-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        t = time.perf_counter()
        run(_scenario_at(path, backend))
        took[backend] = took.get(backend, 0.0) + time.perf_counter() - t
        if verbose:
            print(f"warm-up ({backend}{what}): {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        for backend in backends:
            scenario(backend)
    except BaseException:
        if helper is not None:          # a failed or interrupted warm-up leaves no compiler
            helper.kill()
            helper.wait()
        raise
    if helper is not None:
        precompile.stop_helper(helper)
        # a kernel's cache index written by both processes at once may have lost an entry:
        # a pass over the now warm cache compiles it again (the kernels are the same for both
        # backends: one pass covers them)
        scenario(backends[0], ", again after the helper")
    for backend, path_ in zip(backends, stamps):
        if path_ is None:
            continue
        try:
            os.makedirs(os.path.dirname(path_), exist_ok=True)
            with open(path_, "w") as f:
                f.write(f"warm-up scenario ({backend}) ran in {took[backend]:.1f} s\n")
        except OSError:
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", action="append", choices=["hw", "sim"],
                    help="backend(s) to warm (default both)")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines (Engine.open's child, kernel_cache.ensure_warm)")
    ap.add_argument("--stamp", help="the stamp file to write (with one --backend; the one "
                                    "kernel_cache.ensure_warm waits for)")
    ap.add_argument("--record-signatures", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record_signatures:          # tools/precompile.py --write: on a fresh cache
        from tract_async.tools import precompile
        seen = precompile.record()
        warm_up(backends=("hw", "sim"), jobs=1)
        for m, q, s in seen:
            print(f"{m}\t{q}\t{s}")
        return
    backends = tuple(args.backend or ("hw", "sim"))
    if args.stamp is not None and len(backends) != 1:
        ap.error("--stamp needs exactly one --backend")
    warm_up(backends=backends, verbose=not args.quiet, stamp=args.stamp)


if __name__ == "__main__":
    main()
