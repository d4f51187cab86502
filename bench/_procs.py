"""Two-process benchmark plumbing: a child reports one outcome, the parent gathers and reaps.

Every multi-process benchmark here spawns its children (never forks: Numba, torch and the OFD
locks do not survive a fork) and must end even when a child hangs or raises: a child always sends
exactly one ``("ok", value)`` or ``("error", "Type: message")`` on its result pipe, the parent
waits for all of them under one deadline, and whatever is still alive afterwards is killed.
"""
from __future__ import annotations

import multiprocessing.connection
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterable


def send_outcome(res: Connection, body: Callable[[], Any]) -> None:
    """Run ``body`` and send its value, or the exception that ended it, down ``res``.

    A child that raised must still answer: otherwise the parent learns nothing until its timeout
    and the reason is lost.
    """
    try:
        # the send inside: a value that does not pickle is reported too (pickling precedes the
        # write, so the pipe holds nothing of it)
        res.send(("ok", body()))
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        res.send(("error", f"{type(e).__name__}: {e}"))


def gather(results: dict[str, Connection], timeout_s: float, what: str) -> dict[str, Any] | str:
    """Each child's value by name, or one line naming the child that failed or stayed silent.

    ``results`` maps a child's name to the read end of its result pipe; ``timeout_s`` bounds the
    whole wait, not each child's. The first failure ends the wait: the caller reaps the rest.
    """
    pending = dict(results)
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        ready = multiprocessing.connection.wait(list(pending.values()),
                                                max(0.0, deadline - time.monotonic()))
        if not ready:
            return f"{what}: no result from the {', '.join(pending)} within {timeout_s} s"
        for name, conn in list(pending.items()):
            if conn not in ready:
                continue
            del pending[name]
            status, value = conn.recv()
            if status != "ok":
                return f"{what} failed in the {name}: {value}"
            got[name] = value
    return got


def reap(procs: Iterable[BaseProcess | None], join_s: float) -> None:
    """Join each started child for up to ``join_s``; kill one still alive (a hung child must not
    outlive the run, holding its region or its sockets)."""
    for proc in procs:
        if proc is None:
            continue
        proc.join(join_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
