"""Numba's cache for the engine's kernels: how cold it is, whether this build was warmed into it,
and making sure a process is warm before its node joins.

``cache_state()`` tells how much is cold, and ``notice_if_cold()`` (called by ``Engine.open``,
``tract demo`` and ``tract warmup``) says so on stderr, once per process, before a compile
starts: what compiles, where to, about how long.

Warm before joining (issue 36). Numba compiles on the calling thread and holds the GIL and its
global compiler lock while it does; a process that compiles for seconds *after* its node joined
starves its own lock-manager thread (its scans stall, and it steps down: the cold ``tract demo``
did, twice) and, where the heartbeat thread's own kernel is not loaded yet, its heartbeat. So
``Engine.open`` calls ``ensure_warm`` before it joins the node table: on a cache this build has
not warmed yet (no stamp, ``stamp_path``) it runs the warm-up scenario (``tract_async.tools.warmup``)
first, in a child process, on a throw-away region, under a file lock so that processes started
together compile once; then it loads every kernel the cache holds into this process
(``preload``, ~1 s on the 2-core VM, once per process). After that a compile is a kernel the
scenario does not cover: it is logged (``compiles_after_warmup``), never silent.

This module imports no Engine (the scenario's module does, and re-exports these names).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import hashlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

FULL_COMPILE_S = 42.0
"""Seconds a fully cold compile of every kernel took on the 2-core development VM (the warm-up
scenario: 25 s on 2026-12-01, 42.6 s for 119 kernels on 2026-12-05): the basis of the
notice's estimate."""

_ENGINE_MODULES = ("tract_async.stores.region", "tract_async.sync.lock", "tract_async.sync.manager",
                   "tract_async.engine_layout", "tract_async.cuda.direct")
"""Importing these imports every module whose jitted functions an Engine runs (``cuda.direct``:
its host-side planners, no torch). The stamp's digest (``build_digest``) covers the kernels of
the project's modules a process has imported, so these must bring in all of them: the warm-up
scenario imports ``cuda.direct``, and before it was listed here a process computed one digest
before the scenario and another after it (so every cache was warmed twice)."""

_noticed = False

_in_scenario: contextvars.ContextVar[bool] = contextvars.ContextVar("tract_warmup_scenario",
                                                                    default=False)
"""Set while the scenario runs: its own Engine.open calls must not warm up again."""
_scenarios_running = 0
"""How many scenarios run in this process now. The compile watcher looks at it besides
``_in_scenario``: a thread the scenario's engines start without copying the context (an
executor's) compiles inside the scenario too (the H100 warm-up of 2026-12-06 at e798099 logged
``rows_fine`` as compiled "after the warm-up" while the scenario ran)."""

@contextlib.contextmanager
def scenario_running() -> Iterator[None]:
    """Mark the warm-up scenario as running in this process (and this context) while inside:
    its own ``Engine.open`` calls do not warm up again, and its compiles are not counted as
    compiles after the warm-up."""
    global _scenarios_running
    token = _in_scenario.set(True)
    with _state_lock:
        _scenarios_running += 1
    try:
        yield
    finally:
        with _state_lock:
            _scenarios_running -= 1
        _in_scenario.reset(token)


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
        # Numba's own cache folder (``__pycache__`` beside the module without NUMBA_CACHE_DIR),
        # never the source folder: the stamp and its lock are cache files, not package files
        base = os.environ.get("NUMBA_CACHE_DIR") or ds[0]._cache._cache_path
    except (AttributeError, IndexError):
        return None
    return os.path.join(base, f"tract-warm-{backend}-{build_digest(backend)}")


def preload() -> int:
    """Load every kernel signature Numba's cache holds for this build into this process (no
    compile: an index entry made for another CPU or another source is skipped). Returns how
    many were loaded. Once per process; ~1 s for ~120 signatures on the 2-core VM.

    A signature with a literal argument type is left out: only a call from another kernel
    makes one (a constant argument, such as a flush site's number: a call from Python types an
    int as ``int64``), and the calling kernel's own machine code holds the code it calls, so
    loading it serves no call. That is 53 of 174 signatures and a third of the loading time
    (0.33 of 0.95 s on the 2-core VM), in every process that opens an engine. For the same
    reason a ``forceinline`` kernel is left out (the word accesses, ``kernels/mem.py``): its
    callers hold its code; a call from Python loads it from the cache then (35 signatures,
    ~0.2 s of every preload on the 2-core VM)."""
    global _preloaded
    with _state_lock:
        if _preloaded:
            return 0
        _preloaded = True
    from numba.core.types import Literal
    n = 0
    for d in _engine_dispatchers():
        if d.targetoptions.get("forceinline"):
            continue
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
            if any(isinstance(t, Literal) for t in sig):
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


def warm_lock_path(stamp: str) -> str:
    """The file whose ``flock`` serializes the warm-ups of one cache (beside its stamps): one
    process compiles, the others wait and load. The test session's own kernels compile under
    it too (``tests/conftest.py``)."""
    return os.path.join(os.path.dirname(stamp), "tract-warm.lock")


async def _warm_under_lock(stamp: str, backend: str) -> bool:
    """Run the scenario unless another process did while we waited for the lock (the child
    writes the stamp). The lock is polled (non-blocking ``flock``) so that the event loop keeps
    running and a second opener in this same process waits instead of deadlocking."""
    lock_path = warm_lock_path(stamp)
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
        await _run_scenario_process(backend, stamp)
        if not os.path.exists(stamp):
            raise RuntimeError(f"tract: the warm-up scenario ({backend}) finished without "
                               f"stamping {stamp}: is NUMBA_CACHE_DIR the same for it?")
        return True
    finally:
        os.close(fd)                    # drops the flock


async def _run_scenario_process(backend: str, stamp: str) -> None:
    """``python -m tract_async.tools.warmup --backend <backend> --stamp <stamp>`` in a child process,
    which compiles into this process's cache and writes ``stamp``; this process then loads
    (``preload``). A child,
    not this process: the scenario runs Engines, and the Engine is what calls this module (a
    child keeps the two modules out of an import cycle, issue 37), and its compile holds
    neither this process's GIL nor its loop. The child imports the same packages as this
    process (their directories first on its path). Raises RuntimeError with the child's last
    output lines if it fails."""
    import tract_kernels
    here = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__ or "")))
            for m in (sys.modules[__package__ or "tract_async"], tract_kernels)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*dict.fromkeys(here),
                                         *filter(None, [env.get("PYTHONPATH")])])
    if not sys.executable:
        raise RuntimeError("tract: no Python executable to run the warm-up scenario in "
                           "(sys.executable is empty): run `tract warmup` before opening an Engine")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tract_async.tools.warmup", "--backend", backend, "--stamp", stamp,
        "--quiet",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        tail = "\n".join(out.decode(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"tract: the warm-up scenario ({backend}) failed with exit code "
                           f"{proc.returncode}:\n{tail}")
