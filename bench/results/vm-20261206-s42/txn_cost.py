"""What a put or read transaction adds per operation on the host (issue 37's "every benchmark
within noise"): the transaction's construction and its first step, against the lifecycle call
it wraps, on a real engine over a /dev/shm region (TINY layout, one block being filled).

    python bench/results/vm-20261206-s42/txn_cost.py     # prints a table and the JSON path
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
import timeit

import numpy as np

import tract_async as tract
from tract_async.stores.txn import PutTxn, ReadTxn

N = 200_000


def per_call_ns(fn, n: int = N) -> float:
    best = min(timeit.repeat(fn, number=n, repeat=5))
    return best / n * 1e9


async def main() -> None:
    lay = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=64, dtype="float32")
    path = tempfile.mktemp(prefix="tract-txncost-", dir="/dev/shm")
    cfg = tract.EngineConfig(layout=lay, region=path, region_bytes=32 << 20, create=True,
                             node_id=0, max_nodes=4, namespace="txncost", mem_backend="hw",
                             chunk_bytes=1 << 20)
    try:
        async with tract.Engine.open(cfg) as eng:
            b = eng.parts.store.blocks
            keys = eng.block_keys(range(16))
            kv = np.zeros(lay.kv_shape(1, 0), dtype=np.float32)
            await eng.put_kv(keys, kv, layer=0)          # one block in flight (layers 1-3 to go)
            assert b.filling(keys) is not None
            rows = {
                "lifecycle.filling (before)": per_call_ns(lambda: b.filling(keys)),
                "PutTxn(...).resume() (after)": per_call_ns(
                    lambda: PutTxn(b, keys, 1, 5.0, "cuda").resume()),
                "PutTxn(...) alone": per_call_ns(lambda: PutTxn(b, keys, 1, 5.0, "cuda")),
                "ReadTxn(...) alone": per_call_ns(lambda: ReadTxn(b, keys, 1, 5.0, "cuda")),
                "ReadTxn(..., timeout=None)": per_call_ns(lambda: ReadTxn(b, keys, 1, None, "small")),
            }
    finally:
        if os.path.exists(path):
            os.unlink(path)
    for k, v in rows.items():
        print(f"{k:32s} {v:8.0f} ns")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       time.strftime("txn-cost-%Y%m%d-%H%M%S.json"))
    with open(out, "w") as f:
        json.dump({"python": sys.version.split()[0], "cores": os.cpu_count(),
                   "load": os.getloadavg(), "ns_per_call": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    asyncio.run(main())
