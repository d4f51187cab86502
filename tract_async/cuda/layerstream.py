"""Layer streams: a request's later layers, each one short enqueue.

A layer-streamed prefill calls ``start_put_kv(keys, kv[i], layer=i)`` once per layer, and a
decode worker ``start_get_kv(keys, out=out[i], layer=i)``: the same keys, tensors of the same
shape, 32 times. The whole path (``cuda/api.py`` -> ``cuda/store.py``) re-derives on every
layer what the first layer established: the keys' checks, the tensor's checks, the copier,
whether the direct 2-D copies apply, the copy template (found again by an array comparison),
the payload offsets. Issue 35 asks for <= 30 µs of host time per layer operation; on the GPU
hosts that whole path cost 55-70 µs to start a one-block layer and 20-35 µs to complete it
(``bench/results/gpu-20261207-s48``), spread thinly over ~40 Python calls, so no single
trim can reach the target: the later layers need a path of their own.

This module holds the streams; their steps are ``cuda/store.py``'s (``put_layer``,
``get_layer``), beside the whole path they shorten. A ``PutStream`` or ``GetStream`` is left
behind by a layer operation that took the whole path and went by the direct copies
(``cuda/direct.py``). It holds the checked keys, the tensor's shape, dtype and device, the
copier and the copy template at layer 0 (a get's also the first layer's snapshot). A later
layer of the same keys (found by one list comparison, identity per key first) runs only what
can differ from layer to layer (measured: 10-40 µs less host time to start a later layer on
the H100 host, ``bench/results/gpu-20261207-s49``):

put:  the transaction (``PutTxn``) resumes the reservations (``FillBook.batch_of``: the batch
      must be the very ``FillBatch`` the template was built from, still whole) -> the fence
      check -> the template at this layer and tensor -> the copies on the put stream after
      ``ready`` -> the future, whose completion publishes (its early step from the poller);
      a failed enqueue abandons the request's reservations, as the whole path's does.
get:  the transaction prepares by the first layer's snapshot (``ReadTxn.prepare_known``: the
      layer's bits afresh at the slots found then, state, bounds and namespace), or, where a
      block is not ready for this layer yet, the whole wait and snapshot (``prepare``; its
      payload offsets must be the stream's, else the whole path) -> the CPU-cache record
      (``invalidate_for_dma``) -> the copies -> the future, whose completion re-validates
      every block's version (invariant 6): a block evicted or reused since the first layer
      is a miss there, never wrong bytes. A layer that a validated read of the stream already
      saw published for every block is not re-read at all ("Seen layers" below).

Seen layers. ``prepare_known`` re-reads one entry line per block on every layer (~10 µs of a
213-block layer and ~40 µs of a 1024-block one on the 2-core VM), although a decode worker that
reads after prefill has finished finds every layer in at its first look. Layer bits only grow
while an entry keeps its version: they are set after the layer's bytes landed, and cleared only
when the entry is evicted, which gives its next occupant a new version. So once a read by the
stream's rows has been *validated* (its versions unchanged after its copy, hence unchanged since
the bits were read), every layer those bits showed in for every block stays in, with its bytes
complete, for as long as the versions hold; a later layer among them needs no look, only the
validation after its copy, which every read does anyway (a block evicted meanwhile is a miss
there). The stream learns the bits from the last validated read of its current rows (once per
request: an AND over the rows), forgets them when its rows are replaced, and treats a layer
read a second time as a new request of the same keys (it forgets and looks again), so a prompt
put again after its blocks were consumed or evicted is waited for as before, not missed.

The protocol is the transactions' and is unchanged: a stream skips only checks whose answer
is fixed by the keys, the tensor's shape and the reservation or snapshot, and it declines
(returns None: the caller takes the whole path, which raises whatever is wrong) whenever any of
them differs. ``TRACT_CUDA_LAYER_STREAMS=0`` turns streams off (for A/B runs).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..region.index import READY, SNAP_LAYERS, SNAP_STATE
from ..stores.fillbook import FillBatch

_WORD = (1 << 64) - 1

STREAMS_ENV = "TRACT_CUDA_LAYER_STREAMS"
"""``0``: no layer streams (every layer takes the whole path), for A/B runs."""

KEEP = 8
"""Streams each side remembers (a few requests streaming at once), newest first."""


def enabled() -> bool:
    """Whether layer streams are on (``STREAMS_ENV``; default on)."""
    return os.environ.get(STREAMS_ENV, "1") != "0"


class _Stream:
    """What both sides hold: the keys as the whole path checked them, the tensor's form, the
    copier and the template (``direct.Template``) at layer 0 and tensor address 0."""

    __slots__ = ("keys", "shape", "dtype", "device", "copier", "tmpl", "layers", "nbytes")

    def __init__(self, keys: list[bytes], tensor: Any, copier: Any, tmpl: Any,
                 layers: int) -> None:
        self.keys = keys
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.copier = copier
        self.tmpl = tmpl
        self.layers = layers
        self.nbytes = tmpl.nbytes

    def fits(self, layer: Any, t: Any) -> bool:
        """``layer`` is a layer of the layout and ``t`` a contiguous tensor of the first layer's
        shape, dtype and device (what the whole path's checks established for it)."""
        return (type(layer) is int and 0 <= layer < self.layers and t.shape == self.shape
                and t.dtype == self.dtype and t.device == self.device and t.is_contiguous())


class PutStream(_Stream):
    """A layer-streamed put's later layers (module docstring). ``batch``: the reservations the
    template's offsets came from."""

    __slots__ = ("batch",)

    def __init__(self, keys: list[bytes], tensor: Any, copier: Any, tmpl: Any, layers: int,
                 batch: FillBatch) -> None:
        super().__init__(keys, tensor, copier, tmpl, layers)
        self.batch = batch


class GetStream(_Stream):
    """A layer-streamed get's later layers (module docstring). ``poffs``: the payload offsets
    the template was built from; ``rows`` and ``words``: the first layer's snapshot and the
    keys' index words, by which a later layer is prepared (``ReadTxn.prepare_known``: each
    entry's layer bits afresh at the slots found then, no lookup by key). ``first``: the layer
    whose read made the stream. What it learns of the layers (module docstring, "Seen layers"):
    ``seen``, layers in for every block (bit ``l``: layer ``l``); ``checked``, a validated
    snapshot of ``rows`` not learned from yet; ``asked``, layers read since it last forgot."""

    __slots__ = ("poffs", "rows", "words", "seen", "checked", "asked")

    def __init__(self, keys: list[bytes], tensor: Any, copier: Any, tmpl: Any, layers: int,
                 poffs: np.ndarray, rows: np.ndarray, words: np.ndarray, first: int) -> None:
        super().__init__(keys, tensor, copier, tmpl, layers)
        self.poffs = poffs
        self.rows = rows
        self.words = words
        self.seen = 0
        self.checked: np.ndarray | None = None
        self.asked = 1 << first

    def new_rows(self, rows: np.ndarray) -> None:
        """The stream reads by ``rows`` from now on (a wait found newer entries): what it
        learned of the old ones no longer applies."""
        self.rows = rows
        self.seen, self.checked = 0, None

    def validated(self, base: np.ndarray, snap: np.ndarray) -> None:
        """A read prepared by ``base`` (the stream's rows then) passed its validation with
        ``snap`` (its layer bits read before its copy): learnable while ``base`` is still the
        stream's rows."""
        if base is self.rows:
            self.checked = snap

    def knows(self, layer: int) -> bool:
        """Whether a validated read saw ``layer`` in for every block (then the read needs no
        look at the entries, only its validation). Records ``layer`` as asked; a layer asked
        again starts a new request's reads: forget, and look."""
        bit = 1 << layer
        if self.asked & bit:
            self.seen, self.checked, self.asked = 0, None, 0
        self.asked |= bit
        if self.seen & bit:
            return True
        snap = self.checked
        if snap is None:
            return False
        self.checked = None
        self.seen = layers_in_all(snap, self.layers)
        return bool(self.seen & bit)


def layers_in_all(snap: np.ndarray, layers: int) -> int:
    """The layers every row of ``snap`` has in, as a bit mask (a READY block has them all)."""
    full = (1 << layers) - 1
    part = snap[snap[:, SNAP_STATE] != READY]
    if part.shape[0] == 0:
        return full
    lo = int(np.bitwise_and.reduce(part[:, SNAP_LAYERS])) & _WORD
    hi = int(np.bitwise_and.reduce(part[:, SNAP_LAYERS + 1])) & _WORD
    return (lo | (hi << 64)) & full


class Streams:
    """The streams of one ``CudaPath``: the last ``KEEP`` of each side, found by their keys."""

    def __init__(self) -> None:
        self.on = enabled()
        self.puts: list[PutStream] = []
        self.gets: list[GetStream] = []
        self.used = 0
        """Layer operations that took a stream."""
        self.declined = 0
        """Found a stream and took the whole path after all (a check differed)."""

    @staticmethod
    def _find(streams: list[Any], keys: Any) -> Any:
        for s in streams:
            k = s.keys
            if k is keys or (len(k) == len(keys) and k == keys):
                return s
        return None

    def find_put(self, keys: Any) -> PutStream | None:
        return self._find(self.puts, keys) if self.puts and type(keys) is list else None

    def find_get(self, keys: Any) -> GetStream | None:
        return self._find(self.gets, keys) if self.gets and type(keys) is list else None

    @staticmethod
    def _add(streams: list[Any], s: Any) -> None:
        for i, old in enumerate(streams):
            if old.keys == s.keys:
                del streams[i]
                break
        streams.insert(0, s)
        del streams[KEEP:]

    def add_put(self, s: PutStream) -> None:
        if self.on:
            self._add(self.puts, s)

    def add_get(self, s: GetStream) -> None:
        if self.on:
            self._add(self.gets, s)

    def drop(self, s: Any) -> None:
        for lst in (self.puts, self.gets):
            if s in lst:
                lst.remove(s)
