"""Child processes for the multi-process tests, forked from a warm server instead of spawned.

A spawned child starts Python, imports the package and loads every Numba kernel from the cache
(``kernel_cache.preload``: ~1 s on the idle 2-core VM, several beside busy loops) before it
does anything; the crash-point test starts two such children for each of its 19 points. A
``forkserver`` whose preload (``tests.support.warmproc_preload``) did that work once forks
each child from that state instead: threads never ran in the server, so the fork is clean, and
each child still gets its own engine, region mapping and lock threads, as a spawned one does.

The one difference a test must know: a forkserver child's environment is the server's at its
start, not ``os.environ`` at the time of ``Process.start()``. Pass per-child settings as
arguments (``crashpoints.arm(point)``), never through the environment.
"""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.context import BaseContext

import pytest

PRELOAD = "tests.support.warmproc_preload"


def context() -> BaseContext:
    """The forkserver context with the kernels preloaded (the server starts on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


def stop() -> None:
    """Stop the forkserver (its children are independent processes, stopped by their tests):
    a module that used :func:`context` calls this at its end, so that no server outlives the
    tests that needed it. The standard library offers no public way; this is the one its own
    tests use."""
    from multiprocessing import forkserver
    forkserver._forkserver._stop()


@pytest.fixture(scope="module", autouse=True)
def forkserver_stopped_after_module() -> Iterator[None]:
    """Imported by a test module that uses :func:`context`: stops the server at its end."""
    yield
    stop()
