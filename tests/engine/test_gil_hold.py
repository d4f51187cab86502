"""The short kernels the event loop calls on every small transfer hold the GIL
(``stores/fused.py``, "Holding the GIL"); the long ones, the polls (the loop's spin slices
included) and the copies release it.

A hand-off of the GIL costs ~7.5 µs in an engine process (``bench/gil.py``), paid on each
small put, get and wake-up when one of these kernels releases it. Timing is a benchmark's job;
this test pins the compile options, so that a refactor cannot silently turn them back.
"""
from __future__ import annotations

from typing import Any

import pytest

import tract_async as tract
from tests.support.engine_util import TINY, cfg
from tract_async.keys import keys_to_words
from tract_async.region import index as ix
from tract_async.stores import doorbell as db
from tract_async.stores import fused, waits


def _releases_gil(dispatcher: Any) -> bool:
    return bool(dispatcher.targetoptions.get("nogil", False))


@pytest.mark.parametrize("kernel", [fused.put_blocks, fused.get_blocks, db.set_waiting,
                                    db.publish_and_look, ix.snapshot_batch_held,
                                    ix.revalidate_batch_held],
                         ids=lambda k: k.py_func.__name__)
def test_the_loops_short_kernels_hold_the_gil(kernel: Any) -> None:
    assert not _releases_gil(kernel)


@pytest.mark.parametrize("kernel", [ix.copy_in, ix.copy_out, ix.copy_out_nt, waits.poll_ready,
                                    ix.snapshot_batch, ix.revalidate_batch],
                         ids=lambda k: k.py_func.__name__)
def test_long_kernels_and_thread_polls_release_it(kernel: Any) -> None:
    assert _releases_gil(kernel)


async def test_small_snapshots_take_the_held_kernel(region_path: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait's re-check, a fused get's few keys and a layer read of up to
    ``SNAPSHOT_HOLD_GIL_KEYS`` blocks: held; a larger snapshot: released."""
    calls: list[tuple[str, int]] = []
    for name in ("snapshot_batch", "snapshot_batch_held"):
        real = getattr(ix, name)

        def spy(m: Any, eoff: int, mask: int, mp: int, lanes: int, keys: Any, out: Any,
                _real: Any = real, _name: str = name) -> None:
            calls.append((_name, keys.shape[0]))
            _real(m, eoff, mask, mp, lanes, keys, out)
        monkeypatch.setattr(ix, name, spy)
    async with tract.Engine.open(cfg(region_path, 0, create=True)) as eng:
        index = eng._store.index
        few = keys_to_words(eng.block_keys(range(TINY.block_tokens * 3)))
        held = ix.SNAPSHOT_HOLD_GIL_KEYS
        most = keys_to_words(eng.block_keys(range(TINY.block_tokens * held)))
        many = keys_to_words(eng.block_keys(range(TINY.block_tokens * (held + 1))))
        calls.clear()
        assert (index.snapshot(few)[:, 0] < 0).all()
        assert (index.snapshot(most)[:, 0] < 0).all()
        assert (index.snapshot(many)[:, 0] < 0).all()
    assert calls == [("snapshot_batch_held", 3), ("snapshot_batch_held", held),
                     ("snapshot_batch", held + 1)]
