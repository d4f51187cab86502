"""SmallPath: the one-block CPU put and get of ``Engine.put_kv`` / ``get_kv``, in the fewest steps.

Why. The commonest transfer of a disaggregated server is one 64 KiB block from a contiguous CPU
torch tensor, and on the 16-core H200 host (a Firecracker guest) its Python costs more than its
copy: a back-to-back ``put_kv`` took 30.6 µs, of which the fused kernel (reservation, 64 KiB
copy, publish) 10.6; the layers above ``put_fused`` -- the Engine's checks (5.6 µs), the
store's dispatch, ``keys_to_words`` (3.4) -- each re-test what the layer above had tested
(CUDA or not, how many keys, contiguous, fusable), and right after a wake-up that code runs
2-4x slower again (``bench/wakecost.py``). This path tests the common case once, with a few
attribute reads, and hands it to the same ``BlockLifecycle.put_fused`` / ``get_fused`` as the
full path.

What it takes: a list (or tuple) of one 32-byte key (``bytes`` or ``BlockKey``); for a put a
torch tensor on the CPU, contiguous, of the layout's dtype and one block's shape, all layers
(``layer=None``); for a get the same as ``out``. Anything else -- a numpy array, a
``bytearray`` key, a layer, two keys, a CUDA tensor, a wrong shape -- returns None with
nothing done, and the caller runs the full path, which raises the errors the API documents.
So do: the lock wanted by this process (the full path yields to it first), the ``transfer``
mode on a get (a read consumes the block: an ``await``), and every case the fused kernels decline (a key of this
node in flight, too few free slots, a block absent or not READY, ...). A put or get that this
path completes is the full path's, counted the same (``fused_puts`` / ``fused_gets``), plus
``small_puts`` / ``small_gets``, and timed the same while ``Engine.time_phases`` is on (the
``fused`` phase, and a put's ``publish`` stamp, which the handoff benchmark reads).

The Engine uses it only with the region as its only store (no HTTP fallback or mirror, whose
``FallbackStore`` has its own bookkeeping per put).
"""
from __future__ import annotations

import struct
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..keys import KEY_BYTES, BlockKey
from . import fused
from . import routing as R
from .txn import PutTxn, ReadTxn



class SmallHost(Protocol):
    """What the one-block path uses of its ``RegionStore`` (``stores/region.py``): typed here so
    that this module need not import that one, which imports this one (an import cycle, issue
    37)."""
    cfg: Any
    layout: Any
    blocks: Any
    phases: Any
    yield_to_lock: bool

    def template(self, n: int) -> np.ndarray: ...
    def put_fused(self, txn: PutTxn, src: int, tmpl: np.ndarray) -> int | None: ...

_WORDS = struct.Struct("<4Q")
_KEY_TYPES = (bytes, BlockKey)
"""Exact key types this path takes (``Engine.block_keys`` returns ``BlockKey``, a ``bytes``)."""


class SmallPath:
    """The one-block fast path over one ``RegionStore`` (module docstring)."""

    def __init__(self, store: SmallHost) -> None:
        self.store = store
        self.blocks = store.blocks
        layout = store.layout
        self._shape = layout.kv_shape(1, None)
        self._dtype_name = layout.dtype_name
        self._tensor: type | None = None     # torch.Tensor, once torch is imported
        self._dtype: Any = None
        self._words = np.zeros((1, 4), dtype=np.uint64)
        self._tmpl = store.template(1)
        self.usable = fused.FUSED_MAX_BLOCKS >= 1 and layout.block_bytes <= R.INLINE_COPY_BYTES
        """Whether a one-block transfer is one the fused kernels take at all (fixed by the
        layout)."""

    def _tensor_ok(self, t: Any) -> bool:
        """``t`` is a contiguous CPU torch tensor of one block, the layout's dtype."""
        cls = self._tensor
        if cls is None:
            torch = sys.modules.get("torch")
            if torch is None:
                return False
            self._tensor, self._dtype = torch.Tensor, getattr(torch, self._dtype_name)
            cls = self._tensor
        return (type(t) is cls and t.is_cpu and t.dtype is self._dtype
                and t.shape == self._shape and t.is_contiguous())

    def _key_words(self, keys: Sequence[bytes]) -> tuple[list[bytes], np.ndarray] | None:
        """(the keys as a list, their words) for one 32-byte ``bytes`` key, else None."""
        if type(keys) is not list and type(keys) is not tuple:
            return None
        if len(keys) != 1:
            return None
        k = keys[0]
        if type(k) not in _KEY_TYPES or len(k) != KEY_BYTES:
            return None
        w = self._words
        w[0] = _WORDS.unpack(k)
        return (keys if type(keys) is list else [k]), w

    def _declined(self) -> bool:
        s = self.store
        return not self.usable or (s.yield_to_lock and self.blocks.lock.wanted)

    def put(self, keys: Sequence[bytes], kv: Any) -> int | None:
        """Blocks stored (0 or 1), or None: not this path, nothing done (module docstring)."""
        if self._declined() or not self._tensor_ok(kv):
            return None
        kw = self._key_words(keys)
        if kw is None:
            return None
        txn = PutTxn(self.blocks, kw[0], None, None, "small", words=kw[1])
        done = self.store.put_fused(txn, kv.data_ptr(), self._tmpl)
        if done is not None:
            self.blocks.stats.small_puts += 1
        return done

    def get(self, keys: Sequence[bytes], out: Any) -> bool:
        """True when ``out`` now holds the block; False: not this path (or the block is not
        READY), nothing done (module docstring)."""
        if (self._declined() or self.store.cfg.mode == "transfer"
                or not self._tensor_ok(out)):
            return False
        kw = self._key_words(keys)
        if kw is None:
            return False
        ph = self.store.phases
        t0 = time.perf_counter_ns() if ph is not None else 0
        if not ReadTxn(self.blocks, kw[0], None, None, "small", words=kw[1]).fused(
                out.data_ptr(), self._tmpl):
            return False
        self.blocks.stats.small_gets += 1
        if ph is not None:
            ph.add("fused", t0)
        return True
