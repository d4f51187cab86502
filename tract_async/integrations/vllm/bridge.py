"""A thread that owns an asyncio loop, and the Engine on it, for callers that are not async.

vLLM calls a KV connector from its own threads (the scheduler's busy loop, the model runner's
forward pass), never from a coroutine. The Engine is asyncio-first: its background tasks (the
heartbeat watch, maintenance, pre-claims) need a loop that keeps running while vLLM computes.
So each connector runs one ``LoopThread``: a daemon thread running an event loop forever, with
the Engine opened on it. vLLM's threads hand it coroutines with ``submit`` (``asyncio.
run_coroutine_threadsafe``) and get a ``concurrent.futures.Future`` back at once; a caller that
must have the result blocks in ``Future.result()``, which waits on a condition variable: no
polling sleep anywhere, and the forward pass only ever waits for the one layer it is about to
use.

Why not ``asyncio.run`` per call: a loop per call would stop the engine's background tasks
between calls (the heartbeat would lapse and the rack would evict this node).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """One event loop on one daemon thread (uvloop where installed, like ``tract.run``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        try:
            import uvloop
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            # whatever is still scheduled is cancelled and given a chance to unwind
            pending = asyncio.all_tasks(loop)
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns at once (thread-safe)."""
        if not self.alive:
            coro.close()
            raise RuntimeError(f"{self.name}: the loop thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block this (non-loop) thread for its result."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.call from its own loop thread would deadlock")
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (cancelling what is left on it) and join the thread. Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
