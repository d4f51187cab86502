"""VM: the per-layer meta kernels of a 213-block layer stream (publish, refresh, revalidate)."""
import asyncio, sys, time, tempfile, statistics
import numpy as np
sys.path.insert(0, "/work/main/bench")
import _common as C
import torch
import tract_async as tract
from tract_async.stores.txn import PutTxn, ReadTxn
from tract_async.stores import doorbell as db
from tract_async.stores import plan as kvplan
from tract_async.region.index import SNAP_POFF, SNAP_SLOT, SNAP_VERSION

def t(f, reps=200):
    for _ in range(5): f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns(); f(); ts.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(ts)

async def main(n):
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-meta-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=3 << 30, create=True, remove_on_close=True,
                             layout=lay, namespace="meta")
    async with tract.Engine.open(cfg) as eng:
        b = eng._store.blocks
        keys = eng.block_keys(range(16 * n))
        kv = torch.zeros(lay.kv_shape(n, 0), dtype=lay.dtype)
        await eng.put_kv(keys, kv, layer=0)
        txn = PutTxn(b, keys, 1, None, "cuda"); assert txn.resume()
        res = txn.res
        lo, hi = kvplan.layer_mask(b.layout, 1)
        pub = t(lambda: db.publish_known_and_look(b.mem, b.geo.entries_offset, res.slots, res.layers_lo | lo,
                 res.layers_hi | hi, b._all_lo, b._all_hi, b._db_off, b._db_nodes))
        await eng.put_kv(keys, kv, layer=1)
        rt = ReadTxn(b, keys, 1, None, "cuda")
        snap = await rt.prepare()
        rows = snap.copy()
        ref = t(lambda: b.reader.index.refresh_layers(rows.copy()))
        known = t(lambda: b.reader.prepare_known(rows, 1))
        words = rt.words
        ok = np.empty(n, dtype=np.bool_)
        s, v, p = snap[:, SNAP_SLOT].copy(), snap[:, SNAP_VERSION].copy(), snap[:, SNAP_POFF].copy()
        reval = t(lambda: b.reader.index.revalidate(s, v, p, words, ok))
        val = t(lambda: rt.validate(n * lay.layer_bytes, cpu=False))
        print(f"n={n}: publish_known {pub:.1f} us, refresh {ref:.1f}, prepare_known {known:.1f}, "
              f"revalidate {reval:.1f}, validate {val:.1f}  (backend {b.mem!r:.60})")

for n in map(int, sys.argv[1:] or ["1", "213"]):
    asyncio.run(main(n))
