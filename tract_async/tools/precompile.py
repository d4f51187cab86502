"""Compile the warm-up's kernels in a second process while the scenario runs: a cold warm-up
on two cores in about half the time.

Why. Numba compiles one kernel at a time, holding the GIL: the warm-up scenario
(``tools/warmup.py``) keeps one core busy for ~80-120 s on the 2-core VM (a clean-clone CI
waits for it after its installs, the first ``tract demo`` on a machine too), while the other
core idles. The scenario cannot be cut in two (every part opens engines, and those compile the
same lock, allocator and index kernels first), but the kernels it ends up compiling are known:
``warm_signatures.SIGNATURES`` lists them, in the order the scenario first compiles them. A
helper process (``python -m tract_async.tools.precompile``) compiles that list from its end
backwards into the same ``NUMBA_CACHE_DIR`` while the scenario runs from the start: each side
loads from the cache what the other has compiled by the time it gets there, and they meet
near the middle.

Correctness never depends on the list. A signature that no longer types is skipped; one the
list lacks is compiled by the scenario as before. Two processes writing one function's cache
index may drop an entry (Numba rewrites the index without a lock between processes), so
``warmup.warm_up`` runs the scenario once more after the helper ended: a pass over a warm cache
(~2 s), which compiles whatever was lost, before the stamp says the cache is warm.

The list is generated, not written: ``python -m tract_async.tools.precompile --write`` runs
the scenario on a fresh cache in a child process (``warmup --record-signatures``) and records
every outermost compile (module, function, argument types); ``tests/project/test_precompile.py``
checks that each entry still names a kernel and parses. Regenerate it when kernels or the
scenario change: a stale list only costs time.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HELPER_ENV = "TRACT_WARMUP_JOBS"
"""Processes for a cold warm-up: ``1`` keeps the scenario alone; default 2 where there are
two or more CPUs."""

SIGNATURES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_signatures.py")


def jobs() -> int:
    """The warm-up's processes (``TRACT_WARMUP_JOBS``, else 2 on two or more CPUs)."""
    v = os.environ.get(HELPER_ENV, "")
    if v.strip():
        try:
            return max(1, int(v))
        except ValueError:
            raise ValueError(f"{HELPER_ENV} must be an integer, got {v!r}") from None
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def _namespace() -> dict[str, Any]:
    """Names for ``eval`` of a signature's ``repr``: Numba's types, ``bool`` as Numba's boolean
    (``repr(types.boolean)`` is ``bool``) and ``omitted(default=...)``."""
    from numba.core import types
    ns: dict[str, Any] = {k: getattr(types, k) for k in dir(types) if not k.startswith("_")}
    ns["bool"] = types.boolean
    ns["omitted"] = lambda default: types.Omitted(default)
    ns["__builtins__"] = {}
    return ns


def resolve(module: str, qualname: str, sig: str, ns: dict[str, Any] | None = None
            ) -> tuple[Any, tuple[Any, ...]]:
    """The dispatcher ``module.qualname`` and the argument types ``sig`` (the ``repr`` of a
    tuple of Numba types). Raises ImportError, AttributeError, TypeError, SyntaxError."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not hasattr(obj, "compile") or not hasattr(obj, "py_func"):
        raise TypeError(f"{module}.{qualname} is not a Numba dispatcher")
    args = eval(sig, ns if ns is not None else _namespace())  # noqa: S307 (our own file's text)
    if not isinstance(args, tuple):
        raise TypeError(f"{module}.{qualname}: signature {sig!r} is not a tuple")
    return obj, args


def compile_backwards(entries: list[tuple[str, str, str]]) -> tuple[int, int]:
    """Compile ``entries`` from the last to the first (loading what the cache has). Returns
    (compiled or loaded, skipped)."""
    ns = _namespace()
    done = skipped = 0
    for module, qualname, sig in reversed(entries):
        try:
            d, args = resolve(module, qualname, sig, ns)
            d.compile(args)
            done += 1
        except Exception:      # a stale entry: the scenario compiles what it needs itself
            skipped += 1
    return done, skipped


def start_helper() -> subprocess.Popen | None:
    """The helper process over ``warm_signatures.SIGNATURES`` (same environment, so the same
    ``NUMBA_CACHE_DIR``), or None where the list is empty or the process cannot start."""
    try:
        from .warm_signatures import SIGNATURES
    except ImportError:
        return None
    if not SIGNATURES:
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", "tract_async.tools.precompile"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    except OSError:
        return None


def _die_with_parent() -> None:
    """In the helper, before it runs: SIGKILL when the warm-up that started it dies (Linux
    ``PR_SET_PDEATHSIG``), so that a killed warm-up leaves no compiler running; elsewhere a
    no-op (the helper then ends with its list)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_helper(p: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Wait for the helper (what is left of its list loads from the cache by now), killing it
    past ``timeout_s``."""
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


# -- writing the list -----------------------------------------------------------------------------

def record() -> list[tuple[str, str, str]]:
    """Start recording every outermost kernel compile of this process (module, function,
    argument types), without literal-typed signatures (kernel-to-kernel calls only). Returns
    the list it fills, in order (``python -m tract_async.tools.warmup --record-signatures``
    runs the scenario under it)."""
    from numba.core import event as ev
    from numba.core.types import Literal
    depth = [0]
    seen: list[tuple[str, str, str]] = []

    class _Listener(ev.Listener):
        def on_start(self, event: ev.Event) -> None:
            if depth[0] == 0:
                d = event.data["dispatcher"]
                args = tuple(event.data["args"])
                f = d.py_func
                e = (f.__module__, f.__qualname__, repr(args))
                if not any(isinstance(a, Literal) for a in args) and e not in seen:
                    seen.append(e)
            depth[0] += 1

        def on_end(self, event: ev.Event) -> None:
            depth[0] -= 1

    ev.register("numba:compile", _Listener())
    return seen


def write(path: str = SIGNATURES_FILE) -> int:
    """Record the scenario's compiles on a fresh cache (a child process) and write them to
    ``path`` as ``warm_signatures.py``. Returns how many."""
    with tempfile.TemporaryDirectory(prefix="tract-precompile-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-m", "tract_async.tools.warmup",
                              "--record-signatures"],
                             env=env, check=True, capture_output=True, text=True).stdout
    entries = [tuple(line.split("\t")) for line in out.splitlines() if line.count("\t") == 2]
    lines = ['"""The kernel signatures the warm-up scenario compiles, in the order it first',
             "compiles them (``tools/precompile.py`` says why and how they are used).",
             "",
             "Generated by ``python -m tract_async.tools.precompile --write``: do not edit.",
             '"""',
             "",
             "SIGNATURES: list[tuple[str, str, str]] = ["]
    lines += [f"    ({m!r}, {q!r},\n     {s!r})," for m, q, s in entries]
    lines += ["]", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return len(entries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="regenerate warm_signatures.py (runs the scenario on a fresh cache)")
    args = ap.parse_args()
    if args.write:
        t = time.perf_counter()
        n = write()
        print(f"{SIGNATURES_FILE}: {n} signatures ({time.perf_counter() - t:.0f} s)")
        return
    from .warm_signatures import SIGNATURES
    compile_backwards(list(SIGNATURES))


if __name__ == "__main__":
    main()
