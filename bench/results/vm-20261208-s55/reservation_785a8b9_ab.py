"""The whole prompt's reservation, old tree (785a8b9: blocks.reserve) or new (PutTxn.begin):
213 new 2-MiB blocks, lock-free, on fresh keys, then abandoned; median µs of 200 after 40."""
import os, sys, time, statistics
import numpy as np
import tract_async as tract
from tract_async.engine import run
try:
    from tract_async.region.region import discard
except ImportError:
    def discard(p):
        import os
        if os.path.exists(p): os.unlink(p)
from tract_async.keys import keys_to_words
LAY = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype="float16")
NEW = os.path.exists(os.path.join(os.path.dirname(tract.__file__), "stores", "txn.py"))
async def main():
    path=f"/dev/shm/tract-rab-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=1200 << 20, create=True, node_id=0, layout=LAY, namespace="p", mode="transfer")
    ts, tk = [], []
    try:
        async with tract.Engine.open(cfg) as eng:
            b = eng._store.blocks
            for r in range(240):
                keys = eng.block_keys([r*100000+i for i in range(213*16)])
                t0 = time.perf_counter_ns()
                if NEW:
                    from tract_async.stores.txn import PutTxn
                    txn = PutTxn(b, keys, None, 5.0, "x")
                    await txn.begin()
                    poffs = txn.offsets()
                else:
                    words = keys_to_words(keys)
                    todo = await b.reserve(keys, words, b.snapshot_for_put(words), 5.0)
                    poffs = b.payload_offsets(b.reservations(keys, todo))
                t1 = time.perf_counter_ns()
                assert len(poffs) == 213
                await b.abandon(keys)
                if r >= 40: ts.append(t1 - t0)
    finally:
        discard(path)
    print(f"{'new' if NEW else 'old'} ({tract.__file__}): reservation of 213 blocks, median {statistics.median(ts)/1e3:.1f} us, p10 {np.percentile(ts,10)/1e3:.1f}, p90 {np.percentile(ts,90)/1e3:.1f}")
run(main())
