"""Part 3 of ``bench/putget.py``: ``lookup`` and ``block_keys`` rates, with their floors.

One call is a batch of 1024 resident keys. The lookup floor is one forced DRAM miss per key
(invalidate + mfence + load, serialised by the fence), timed by a small kernel over the same
index entries; the block_keys floor is a plain loop of SHA-256 over canonical CBOR (vLLM's
``sha256_cbor``) of one block's payload.
"""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Callable

import numpy as np

import _common as C
import tract_async as tract
import tract_kernels as K
from tract_async.keys import keys_to_words
from tract_async.region.index import E_STATE, ENTRY_BYTES
from tract_async.stores import plan as kvplan

from _putget.fixtures import LAYOUT, MiB, S_BENCH, engine_cfg, make_kv, shm_path, timeit


@functools.cache
def inval_loads() -> Callable[[Any, int, int], int]:
    """The lookup floor's kernel, built on first use (importing this module compiles nothing):
    ``f(mem, entries_offset_bytes, n_entries)`` loads the state word (the word a lookup reads) of
    each of the first ``n_entries`` index entries fresh (invalidate + mfence + load), in a
    scattered order (a stride of 7919 entries modulo ``n_entries``)."""
    from numba import njit

    @njit(nogil=True)
    def f(mem, entries_offset_bytes, n_entries):  # noqa: ANN001, ANN202 - a Numba kernel
        acc = np.uint64(0)
        for i in range(n_entries):
            acc += K.load_fresh(mem, entries_offset_bytes + (i * 7919 % n_entries) * ENTRY_BYTES
                                + E_STATE, S_BENCH)
        return acc
    return f


async def part_keys(quick: bool) -> dict[str, Any]:
    """Rows of us per call, ns per key and M keys/s per operation, and every sample."""
    path = shm_path("keys")
    nkeys = 1024
    reps = 50 if quick else 200
    try:
        async with tract.Engine.open(engine_cfg(path, 0, 160 * MiB, True)) as eng:
            keys = eng.block_keys(list(range(nkeys * LAYOUT.block_tokens)))
            assert len(keys) == nkeys
            kv = make_kv(nkeys)
            await eng.put_kv(keys, kv)
            del kv
            assert eng.lookup(keys) == nkeys
            words = keys_to_words(keys)
            t_lookup = timeit(lambda: eng.lookup(keys), reps)
            t_jit = timeit(lambda: eng._store.index.lookup(words), reps)
            t_check = timeit(lambda: kvplan.check_keys(keys), reps)
            t_words = timeit(lambda: keys_to_words(keys), reps)
            m = eng.region.mem
            eoff = eng._store.geo.entries_offset
            floor = inval_loads()
            floor(m, eoff, nkeys)  # compile
            t_miss = timeit(lambda: floor(m, eoff, nkeys), reps)
            toks = list(range(10_000, 10_000 + nkeys * LAYOUT.block_tokens))
            t_bk = timeit(lambda: eng.block_keys(toks), 5 if quick else 10)
            payload = [hashlib.sha256(bytes(64)).digest(), tuple(range(16)), None]
            import cbor2
            t_sha = timeit(lambda: [hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
                                    for _ in range(nkeys)], 5 if quick else 10)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    ks = {"lookup": t_lookup, "lookup_jitted_only": t_jit, "check_keys": t_check,
          "keys_to_words": t_words, "floor_inval_load_per_key": t_miss, "block_keys": t_bk,
          "floor_sha256_cbor_loop": t_sha}
    rows = []
    for name, v in ks.items():
        med = C.median(v)
        rows.append({"op": name, "keys": nkeys, "us_per_call": med * 1e6, "ns_per_key": med / nkeys * 1e9,
                     "Mkeys_per_s": nkeys / med / 1e6})
    return {"rows": rows, "samples_s": ks}
