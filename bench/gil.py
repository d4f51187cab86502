"""What a GIL hand-off costs on this host: why the loop's short kernels hold the GIL.

A call that releases the GIL and takes it back (a ``nogil=True`` Numba kernel, a ctypes call, a
socket syscall) is measured right after the calling thread ran Python for ``work_us``, in three
states of the process:

* ``alone``: the main thread only;
* ``idle thread``: a second thread exists, asleep in ``Event.wait`` (it never wants the GIL);
* ``thread woke``: a second thread sleeps in ``time.sleep(0.05)`` loops, so it has woken and
  waited for the GIL at least once -- what every engine process looks like (its heartbeat and
  lock-manager threads).

The baseline in the same run is the same call compiled ``nogil=False`` (it never releases the
GIL). ``stores/fused.py`` ("Holding the GIL") quotes these figures.

    python bench/gil.py            # table, and bench/results/gil-<time>-<commit>.json
"""
from __future__ import annotations

import argparse
import ctypes
import threading
import time
from typing import Any, Callable

from numba import njit

import _common as C


@njit(nogil=True)
def _released(x: int) -> int:
    return x + 1


@njit
def _held(x: int) -> int:
    return x + 1


def _cost_us(fn: Callable[[], Any], work_us: float, reps: int) -> float:
    """Median µs of ``fn()`` right after ``work_us`` of Python (a spin on the clock)."""
    ts = []
    for _ in range(reps):
        end = time.perf_counter() + work_us / 1e6
        while time.perf_counter() < end:
            pass
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return C.median(ts) / 1e3


def _row(state: str, work_us: float, reps: int, libc: Any) -> dict[str, Any]:
    return {"state": state, "python_before_us": work_us,
            "numba_nogil_us": _cost_us(lambda: _released(1), work_us, reps),
            "numba_held_us": _cost_us(lambda: _held(1), work_us, reps),
            "ctypes_getpid_us": _cost_us(libc.getpid, work_us, reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=400)
    args = ap.parse_args()
    libc = ctypes.CDLL(None)
    _released(1), _held(1)
    rows = []
    for w in (0.0, 50.0, 500.0):
        rows.append(_row("alone", w, args.reps, libc))
    ev = threading.Event()
    threading.Thread(target=ev.wait, daemon=True).start()
    for w in (0.0, 50.0, 500.0):
        rows.append(_row("idle thread", w, args.reps, libc))

    def sleeper() -> None:
        while not ev.is_set():
            time.sleep(0.05)
    threading.Thread(target=sleeper, daemon=True).start()
    time.sleep(0.2)                 # it has woken (and waited for the GIL) a few times
    for w in (0.0, 50.0, 500.0):
        rows.append(_row("thread woke", w, args.reps, libc))
    ev.set()
    cols = ["state", "python_before_us", "numba_nogil_us", "numba_held_us", "ctypes_getpid_us"]
    print("median µs of one call right after python_before_us of Python")
    print(C.table(rows, cols))
    path = C.write_json("gil", {"reps": args.reps, "rows": rows})
    print(f"\n{path}")


if __name__ == "__main__":
    main()
