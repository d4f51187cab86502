"""Compile every jitted path once, so that later processes load machine code from the cache.

Numba compiles on first call (seconds per function family on a cold cache). A rack of freshly
started processes that all compile at once on a small machine can miss its own heartbeats and
lock deadlines while it does. ``python -m tract_async.warmup`` (or ``warm_up()``) runs a short
scenario that exercises the kernels, the index, the waits, the lock and its manager, the
allocator and fsck on a throw-away region in ``/dev/shm``, on both memory backends, and removes
the region. With ``NUMBA_CACHE_DIR`` set, everything after it starts warm.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import numpy as np
import torch


async def _scenario(path: str, backend: str) -> None:
    import tract_async as tract
    from tract_async.stores import waits
    from tract_async.region import index as ix
    layout = tract.KVLayout(num_layers=2, block_tokens=16, kv_heads=1, head_dim=32,
                            dtype=torch.float32)
    common = dict(layout=layout, region=path, region_bytes=8 << 20, max_nodes=4,
                  namespace="warmup", mem_backend=backend, heartbeat_interval_s=0.05,
                  liveness_timeout_s=5.0)
    a = await tract.Engine.open(tract.EngineConfig(**common, create=True, node_id=0))
    b = await tract.Engine.open(tract.EngineConfig(**common, node_id=1))
    try:
        keys = a.block_keys(range(48))
        kv = torch.randn(layout.kv_shape(len(keys)))
        # the wait paths; a generous deadline: on a cold cache the puts below compile first
        waiter = asyncio.create_task(b.get_kv(keys, layer=1, timeout=600))
        for layer in range(layout.num_layers):
            await a.put_kv(keys, kv[layer].contiguous(), layer=layer)
        await waiter
        assert torch.equal(await b.get_kv(keys), kv)
        b.lookup(keys)
        one = a.block_keys(range(2000, 2016))      # the 1-block fast paths (scalar publish)
        await a.put_kv(one, torch.randn(layout.kv_shape(1)))
        await b.get_kv(one)
        more = a.block_keys(range(1000, 1064))
        await a.put_kv(more, torch.randn(layout.kv_shape(len(more))))
        await a._store.maintain(timeout=10)
        st = b._store
        stop = np.zeros(1, dtype=np.uint8)
        waits.poll_ready(st.mem, st.geo.entries_offset, st.index.mask, st.geo.max_probe,
                         np.zeros((1, 4), dtype=np.uint64), 0, np.uint64(1), True, 0, stop,
                         np.zeros((1, 8), dtype=np.int64))
        waits.poll_present(st.mem, st.geo.entries_offset, st.index.mask, st.geo.max_probe,
                           np.zeros((1, 4), dtype=np.uint64), 0, stop)
        ix.scan_entries(st.mem, st.geo.entries_offset, st.geo.capacity,
                        np.zeros((st.geo.capacity, 9), dtype=np.int64))
    finally:
        await b.close()
        await a.close()
    from tract_async.fsck import run_fsck
    run_fsck(path, backend=backend)


def warm_up(*, backends: tuple[str, ...] = ("hw", "sim"), verbose: bool = False) -> float:
    """Run the scenario on each backend; returns the seconds it took."""
    from tract_async.engine import run
    t0 = time.perf_counter()
    for backend in backends:
        path = f"/dev/shm/tract-warmup-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            run(_scenario(path, backend))
        finally:
            if os.path.exists(path):
                os.unlink(path)
        if verbose:
            print(f"warm-up ({backend}): {time.perf_counter() - t0:.1f} s", flush=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", action="append", choices=["hw", "sim"],
                    help="backend(s) to warm (default both)")
    args = ap.parse_args()
    warm_up(backends=tuple(args.backend or ("hw", "sim")), verbose=True)


if __name__ == "__main__":
    main()
