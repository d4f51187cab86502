"""Compile every jitted path once, so that later processes load machine code from the cache.

Numba compiles on first call (seconds per function family on a cold cache). A rack of freshly
started processes that all compile at once on a small machine can miss its own heartbeats and
lock deadlines while it does. ``python -m tract_async.warmup`` (or ``warm_up()``) runs a short
scenario that exercises the kernels, the index, the waits, the lock and its manager, the
allocator and fsck on a throw-away region in ``/dev/shm``, on both memory backends, and removes
the region. With ``NUMBA_CACHE_DIR`` set, everything after it starts warm.

A cold cache is otherwise silent for tens of seconds (the first ``tract demo`` sat 41 s without
a word). ``cache_state()`` tells how much is cold, and ``notice_if_cold()`` (called by
``Engine.open``, ``tract demo`` and ``tract warmup``) says so on stderr, once per process, before
the compile starts: what compiles, where to, about how long.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

FULL_COMPILE_S = 42.0
"""Seconds a fully cold compile of every kernel took on the 2-core development VM (the warm-up
scenario: 25 s on 2026-12-01, 42.6 s for 119 kernels on 2026-12-05): the basis of the
notice's estimate."""

_ENGINE_MODULES = ("tract_async.stores.region", "tract_async.sync.lock", "tract_async.sync.manager",
                   "tract_async.engine_layout")
"""Importing these imports every module whose jitted functions an Engine runs."""

_noticed = False


@dataclass(frozen=True, kw_only=True)
class CacheState:
    """How much of the engine's jitted code Numba's cache holds for this build.

    Numba keys a module's cache entries on its source file's stamp, so an edited module is
    cold as a whole; a module counts as cold when none of its jitted functions has a valid
    cache index (functions only ever called from other jitted code never get an index of
    their own, so per-function counts would never reach the total even when warm)."""
    cold_modules: tuple[str, ...]
    cold_functions: int
    total_functions: int
    cache_dirs: tuple[str, ...]

    @property
    def cold(self) -> bool:
        return bool(self.cold_modules)

    @property
    def estimate_s(self) -> float:
        """Rough seconds to compile what is cold, scaled from ``FULL_COMPILE_S``."""
        return FULL_COMPILE_S * self.cold_functions / max(1, self.total_functions)


def _has_valid_index(dispatcher: object) -> bool | None:
    """Whether Numba's cache holds an index for this function that matches its source (None:
    this Numba's cache internals are not the ones known here)."""
    try:
        return bool(dispatcher._cache._cache_file._load_index())  # type: ignore[attr-defined]
    except AttributeError:
        return None


def cache_state() -> CacheState | None:
    """The cache state of every jitted function an Engine uses (imports those modules, compiles
    nothing). None where Numba's cache cannot be inspected."""
    from numba.core.dispatcher import Dispatcher
    for name in _ENGINE_MODULES:
        importlib.import_module(name)
    cold: list[str] = []
    cold_n = total = 0
    dirs: set[str] = set()
    for name, mod in sorted(sys.modules.items()):
        if not name.startswith(("tract_kernels", "tract_async")) or mod is None:
            continue
        funcs = [v for v in vars(mod).values() if isinstance(v, Dispatcher) and v.__module__ == name]
        if not funcs:
            continue
        valid = [_has_valid_index(f) for f in funcs]
        if None in valid:
            return None
        total += len(funcs)
        dirs.add(str(getattr(funcs[0]._cache, "cache_path", "?")))
        if not any(valid):
            cold.append(name.rsplit(".", 1)[-1])
            cold_n += len(funcs)
    return CacheState(cold_modules=tuple(cold), cold_functions=cold_n, total_functions=total,
                      cache_dirs=tuple(sorted(dirs)))


def notice_if_cold() -> CacheState | None:
    """Say on stderr (a logging warning), once per process, that the kernels are about to be
    compiled, when the cache is cold. Returns the state when it gave the notice."""
    global _noticed
    if _noticed:
        return None
    _noticed = True
    st = cache_state()
    if st is None or not st.cold:
        return None
    where = (os.environ.get("NUMBA_CACHE_DIR") or
             (os.path.commonpath(st.cache_dirs) if st.cache_dirs else "?"))
    log.warning("tract: compiling %d Numba kernels (modules %s) into %s: about %.0f s on a 2-core "
                "VM, once per cache (`tract warmup` does it ahead of time) ...", st.cold_functions,
                ", ".join(st.cold_modules), where, max(1.0, st.estimate_s))
    return st


async def _scenario(path: str, backend: str) -> None:
    import tract_async as tract
    from tract_async.stores import doorbell as db
    from tract_async.stores import waits
    from tract_async.region import index as ix
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=1, head_dim=32,
                            dtype="float32")
    rng = np.random.default_rng(0)     # numpy arrays: the warm-up needs no torch (arrays.py)

    def randn(n: int) -> np.ndarray:
        return rng.standard_normal(layout.kv_shape(n), dtype=np.float32)
    common = dict(layout=layout, region=path, region_bytes=8 << 20, max_nodes=4,
                  namespace="warmup", mem_backend=backend, heartbeat_interval_s=0.05,
                  liveness_timeout_s=5.0)
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
        waiter = asyncio.create_task(b.get_kv(keys, layer=1, timeout=600))
        for layer in range(layout.num_layers):
            await a.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
        await waiter
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
        await a._store.maintain(timeout=10)
        st = b._store
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
    finally:
        await b.close()
        await a.close()
    from tract_async.fsck import run_fsck
    run_fsck(path, backend=backend)


def warm_up(*, backends: tuple[str, ...] = ("hw", "sim"), verbose: bool = False) -> float:
    """Run the scenario on each backend; returns the seconds it took. ``verbose``: the cold
    cache notice (if cold) and one line per backend on stdout."""
    from tract_async.engine import run
    if verbose:
        notice_if_cold()
    t0 = time.perf_counter()
    for backend in backends:
        path = f"/dev/shm/tract-warmup-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            run(_scenario(path, backend))
        finally:
            if os.path.exists(path):
                os.unlink(path)
            from tract_async.region import cpumarks
            cpumarks.remove(path, None)
        if verbose:
            print(f"warm-up ({backend}): {time.perf_counter() - t0:.1f} s", flush=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", action="append", choices=["hw", "sim"],
                    help="backend(s) to warm (default both)")
    args = ap.parse_args()
    warm_up(backends=tuple(args.backend or ("hw", "sim")), verbose=True)


if __name__ == "__main__":
    main()
