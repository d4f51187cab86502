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

Warm before joining (issue 36). Numba compiles on the calling thread and holds the GIL and its
global compiler lock while it does; a process that compiles for seconds *after* its node joined
starves its own lock-manager thread (its scans stall, and it steps down: the cold ``tract demo``
did, twice) and, where the heartbeat thread's own kernel is not loaded yet, its heartbeat. So
``Engine.open`` calls ``ensure_warm`` before it joins the node table: on a cache this build has
not warmed yet (no stamp, ``stamp_path``) it runs the warm-up scenario first, in this process,
on a throw-away region, under a file lock so that processes started together compile once;
then it loads every kernel the cache holds into this process (``preload``, ~1 s on the 2-core
VM, once per process). After that a compile is a kernel the scenario does not cover: it is
logged (``compiles_after_warmup``), never silent.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import fcntl
import hashlib
import importlib
import logging
import os
import sys
import threading
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

WARMUP_LIVENESS_S = 120.0
"""The liveness timeout of the scenario's throw-away engines. Their own lock manager runs while
the scenario compiles (seconds per kernel family, with the GIL and Numba's compiler lock held),
so a rack-like timeout would make it step down, as the cold demo's did with 10 s (stall 6.6 s);
nothing else shares their region, so a long timeout costs nothing."""

_in_scenario: contextvars.ContextVar[bool] = contextvars.ContextVar("tract_warmup_scenario",
                                                                    default=False)
"""Set while the scenario runs: its own Engine.open calls must not warm up again."""
_scenarios_running = 0
"""How many scenarios run in this process now. The compile watcher looks at it besides
``_in_scenario``: a thread the scenario's engines start without copying the context (an
executor's) compiles inside the scenario too (the H100 warm-up of 2026-12-06 at e798099 logged
``rows_fine`` as compiled "after the warm-up" while the scenario ran)."""

_state_lock = threading.Lock()
_warm_backends: set[str] = set()
"""Backends ``ensure_warm`` finished in this process (a stamp was found or written)."""
_preloaded = False
_after_warmup: list[str] = []
"""Kernels compiled in this process after ``ensure_warm`` finished (``compiles_after_warmup``)."""
_watching = False


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


def _engine_dispatchers() -> list:
    """Every jitted function (Numba dispatcher) of the modules an Engine imports."""
    from numba.core.dispatcher import Dispatcher
    for name in _ENGINE_MODULES:
        importlib.import_module(name)
    out = []
    for name, mod in sorted(sys.modules.items()):
        if not name.startswith(("tract_kernels", "tract_async")) or mod is None:
            continue
        out += [v for v in vars(mod).values()
                if isinstance(v, Dispatcher) and v.__module__ == name]
    return out


def build_digest(backend: str) -> str:
    """What a warm-up stamp stands for: this Numba and Python, the backend, and every kernel
    module's source stamp (path, mtime, size: what Numba keys its own cache on, so an edited
    module makes the stamp stale exactly when it makes Numba's cache stale)."""
    import numba
    parts = [numba.__version__, sys.version, backend]
    for d in _engine_dispatchers():
        path = sys.modules[d.__module__].__file__ or d.__module__
        try:
            st = os.stat(path)
            parts.append(f"{path}:{st.st_mtime_ns}:{st.st_size}")
        except OSError:
            parts.append(f"{path}:?")
    return hashlib.sha256("\n".join(sorted(set(parts[3:])) + parts[:3]).encode()).hexdigest()[:24]


def stamp_path(backend: str) -> str | None:
    """The file whose presence says "the warm-up scenario ran for this build and backend into
    this cache" (``build_digest``); None where Numba's cache cannot be located."""
    ds = _engine_dispatchers()
    try:
        base = os.environ.get("NUMBA_CACHE_DIR") or os.path.dirname(ds[0]._cache._cache_path)
    except (AttributeError, IndexError):
        return None
    return os.path.join(base, f"tract-warm-{backend}-{build_digest(backend)}")


def preload() -> int:
    """Load every kernel signature Numba's cache holds for this build into this process (no
    compile: an index entry made for another CPU or another source is skipped). Returns how
    many were loaded. Once per process; ~1 s for ~150 signatures on the 2-core VM."""
    global _preloaded
    with _state_lock:
        if _preloaded:
            return 0
        _preloaded = True
    n = 0
    for d in _engine_dispatchers():
        try:
            cache = d._cache
            index = cache._cache_file._load_index()
            codegen = d.targetctx.codegen()
        except AttributeError:          # another Numba's internals: lazy loading as before
            return n
        for key in index:
            sig = key[0]
            if tuple(sig) in d.overloads or cache._index_key(sig, codegen) != key:
                continue
            d.compile(sig)
            n += 1
    return n


def _watch_compiles() -> None:
    """From now on, record (and log) every kernel this process compiles: after the warm-up
    nothing should (the event is Numba's "numba:compile", which a cache load does not fire)."""
    global _watching
    with _state_lock:
        if _watching:
            return
        _watching = True
    from numba.core import event as ev

    class _Listener(ev.Listener):
        def on_start(self, event: ev.Event) -> None:
            disp = event.data.get("dispatcher") if isinstance(event.data, dict) else None
            name = getattr(getattr(disp, "py_func", None), "__qualname__", str(disp))
            mod = getattr(disp, "__module__", "?")
            if _in_scenario.get() or _scenarios_running:
                return      # the scenario compiles, in any of this process's threads
            _after_warmup.append(f"{mod}.{name}")
            log.warning("tract: compiling kernel %s.%s after the warm-up (a path the warm-up "
                        "scenario does not cover): this thread holds the GIL while it compiles",
                        mod, name)

        def on_end(self, event: ev.Event) -> None:
            pass

    ev.register("numba:compile", _Listener())


def compiles_after_warmup() -> list[str]:
    """The kernels this process compiled after ``ensure_warm`` finished (module.function, in
    order; a compile inside another process's scenario is not counted)."""
    return list(_after_warmup)


async def ensure_warm(backend: str | None = None) -> bool:
    """Make sure this process will not compile an engine kernel once its node has joined:
    run the warm-up scenario here if no stamp says this build was warmed into this cache (under
    a file lock: processes started together compile once, the others wait and load), then load
    every cached kernel (``preload``). Called by ``Engine.open`` before it joins the node table.
    Returns True when it ran the scenario. A no-op inside the scenario itself."""
    from tract_kernels.mem import resolve_backend
    be = "sim" if resolve_backend(backend) == resolve_backend("sim") else "hw"
    if _in_scenario.get():
        return False
    ran = False
    if be not in _warm_backends:
        stamp = stamp_path(be)
        if stamp is None or os.path.exists(stamp):
            pass
        else:
            ran = await _warm_under_lock(stamp, be)
        _warm_backends.add(be)
    preload()
    _watch_compiles()
    return ran


async def _warm_under_lock(stamp: str, backend: str) -> bool:
    """Run the scenario unless another process did while we waited for the lock; write the
    stamp. The lock is polled (non-blocking ``flock``) so that the event loop keeps running
    and a second opener in this same process waits instead of deadlocking."""
    lock_path = os.path.join(os.path.dirname(stamp), "tract-warm.lock")
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:                     # no writable cache: compile lazily, as before
        return False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.05)
        if os.path.exists(stamp):
            return False
        notice_if_cold()
        path = f"/dev/shm/tract-warmup-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        await _scenario_at(path, backend)
        with open(stamp, "w") as f:
            f.write(f"warm-up scenario ({backend}) ran in {time.perf_counter() - t0:.1f} s\n")
        return True
    finally:
        os.close(fd)                    # drops the flock


async def _scenario_at(path: str, backend: str) -> None:
    """The scenario on a throw-away region at ``path``, removed afterwards."""
    global _scenarios_running
    token = _in_scenario.set(True)
    _scenarios_running += 1
    try:
        await _scenario(path, backend)
    finally:
        _scenarios_running -= 1
        _in_scenario.reset(token)
        from tract_async.region.region import discard
        discard(path)


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
        waiter = asyncio.create_task(b.get_kv(keys, layer=1, timeout=600))
        for layer in range(layout.num_layers):
            await a.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
        await waiter
        for layer in range(layout.num_layers):      # later layers take the known slots
            await b.get_kv(keys, layer=layer)
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
        st.index.expired_transfer(0)                # transfer-mode maintenance's pass
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
        finally:
            await d.close()
            await c.close()
    finally:
        await b.close()
        await a.close()
    # the CUDA direct path's host-side planners (no CUDA call): a GPU host's first put would
    # compile them after the warm-up
    from tract_async.cuda import direct
    direct.template(layout, np.arange(3, dtype=np.int64) * layout.block_bytes, False, 0)
    from tract_async.fsck import run_fsck
    run_fsck(path, backend=backend)


async def _read_layers(engine: object, keys: list[bytes], num_layers: int) -> None:
    """A decode worker's reads: every layer in order, each waiting for its publication."""
    for layer in range(num_layers):
        await engine.get_kv(keys, layer=layer, timeout=600)   # type: ignore[attr-defined]


def warm_up(*, backends: tuple[str, ...] = ("hw", "sim"), verbose: bool = False) -> float:
    """Run the scenario on each backend and stamp the cache (``stamp_path``), so that a later
    ``Engine.open`` only loads; returns the seconds it took. ``verbose``: the cold cache notice
    (if cold) and one line per backend on stdout."""
    from tract_async.engine import run
    if verbose:
        notice_if_cold()
    t0 = time.perf_counter()
    for backend in backends:
        path = f"/dev/shm/tract-warmup-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        t = time.perf_counter()
        run(_scenario_at(path, backend))
        stamp = stamp_path(backend)
        if stamp is not None:
            try:
                os.makedirs(os.path.dirname(stamp), exist_ok=True)
                with open(stamp, "w") as f:
                    f.write(f"warm-up scenario ({backend}) ran in {time.perf_counter() - t:.1f} s\n")
            except OSError:
                pass
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
