"""Helpers of the tests that stop or kill engine processes at crash points
(``tests/engine/test_crash_points.py``, ``tests/engine/test_paused_fencing.py``): a blocking
call off the loop, the next report of a child with a stack dump on timeout, whether a child
stopped itself, and the end of such a test (the child gone, the region clean, no chunk left)."""
from __future__ import annotations

import asyncio
import os
import queue
import signal
from typing import Any, Callable

from tract_async.tools.fsck import run_fsck
from tract_async.region import Region
from tract_async.region.chunks import ChunkTable
from tests.support import procs_engine as P
from tests.support import warmproc


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def report(q: Any, procs: list, timeout: float) -> Any:
    """The next report on ``q``; if none comes within ``timeout``, every child's stacks go to
    the captured stderr (``procs_engine.dump_and_kill``) and the test fails naming the wait."""
    try:
        return await in_thread(q.get, True, timeout)
    except queue.Empty:
        for p in procs:
            await in_thread(P.dump_and_kill, p)
        raise AssertionError(f"no report within {timeout} s; the children's stacks are in the "
                             f"captured stderr") from None


def start_paused_worker(region_path: str, point: str) -> tuple[Any, Any, Any]:
    """``procs_engine.paused_worker`` in a child forked warm (``tests/support/warmproc``: a
    module that calls this stops the server at its end) that stops itself (SIGSTOP) at crash
    point ``point``, given as an argument (the child has the server's environment); returns
    ``(process, q_in, q_out)``."""
    ctx = warmproc.context()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=P.paused_worker, args=(region_path, q_in, q_out, point))
    worker.start()
    return worker, q_in, q_out


def stopped(pid: int) -> bool:
    """The process is stopped (state T in /proc: it stopped itself at its point)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def end_worker(worker: Any) -> None:
    """A worker still alive (stopped or not) is continued, killed and joined."""
    if worker.is_alive():
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        worker.join(10)


async def assert_region_clean(path: str, liveness_timeout_s: float) -> None:
    """fsck finds nothing, and no chunk is left claimed (every engine has closed)."""
    rep = await in_thread(lambda: run_fsck(path, liveness_timeout_s=liveness_timeout_s))
    assert rep.clean, rep.text()
    with Region.attach(path, readonly=True) as r:
        assert int(ChunkTable(r).bitmap().sum()) == 0, "chunks left claimed after both closed"
