"""Per-step host cost of the metadata a CUDA layer put/get runs (no copy), per block count."""
import asyncio, os, sys, tempfile, time, statistics as S
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import _common as C
import numpy as np
import tract_async as tract
from tract_async.stores.txn import PutTxn, ReadTxn
from tract_async.cuda import store as cs
from tract_async.region.index import SNAP_POFF

pc = time.perf_counter_ns
async def main():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s48-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(3 << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="s48")
    async with tract.Engine.open(cfg) as eng:
        st = eng._store; b = st.blocks
        for n in [int(x) for x in sys.argv[1:]] or [1, 32, 213, 1024]:
            T = {}
            def add(k, t0): T.setdefault(k, []).append((pc() - t0) / 1e3)
            for rnd in range(6):
                keys = eng.block_keys(range(rnd*10**7 + n*100000, rnd*10**7 + n*100000 + 16*n))
                for i in range(lay.num_layers):
                    t0 = pc()
                    txn = PutTxn(b, keys, i, None, "cuda")
                    if not txn.resume():
                        await txn.begin()
                    if i: add("put.txn", t0)
                    t0 = pc(); poffs = txn.offsets(); b.alloc.check_not_fenced()
                    if i: add("put.offsets+fence", t0)
                    t0 = pc(); txn.publish(n * lay.layer_bytes)
                    if i: add("put.publish", t0)
                for i in range(lay.num_layers):
                    t0 = pc()
                    rt = ReadTxn(b, keys, i, None, "cuda")
                    snap = await rt.prepare()
                    if i: add("get.prepare", t0)
                    t0 = pc(); poffs = snap[:, SNAP_POFF].copy(); await cs.invalidate_for_dma(b, poffs, i)
                    if i: add("get.inval", t0)
                    t0 = pc(); rt.validate(n * lay.layer_bytes, cpu=False)
                    if i: add("get.validate", t0)
                await b.evict(keys)
            print(n, "  ".join(f"{k} {S.median(v):.1f}" for k, v in T.items()), flush=True)
if not os.environ.get("DETAIL"): asyncio.run(main())

async def detail():
    lay = C.llama_layout()
    path = tempfile.mktemp(prefix="tract-s48-", dir="/dev/shm")
    cfg = tract.EngineConfig(region=path, region_bytes=(10 << 30), create=True,
                             remove_on_close=True, layout=lay, namespace="s48")
    async with tract.Engine.open(cfg) as eng:
        b = eng._store.blocks
        idx = b.reader.index
        print("meta_threads", idx.meta_threads)
        from tract_async.region.index import SNAP_SLOT, SNAP_VERSION
        for n in (213, 1024, 2048, 4096):
            keys = eng.block_keys(range(n*100000, n*100000 + 16*n))
            txn = PutTxn(b, keys, None, None, "cuda"); await txn.begin(); txn.publish(n*lay.block_bytes)
            from tract_async.keys import keys_to_words
            w = keys_to_words(keys)
            rt = ReadTxn(b, keys, 0, None, "cuda"); snap = await rt.prepare()
            T = {}
            for r in range(30):
                ok = np.ones(n, dtype=np.bool_)
                t0 = pc(); idx.revalidate(snap[:, SNAP_SLOT], snap[:, SNAP_VERSION], snap[:, SNAP_POFF], rt.words, ok); T.setdefault("revalidate", []).append((pc()-t0)/1e3)
                t0 = pc(); b.reader.touch(snap[:, SNAP_SLOT], snap[:, SNAP_VERSION]); T.setdefault("touch", []).append((pc()-t0)/1e3)
                t0 = pc(); idx.snapshot(w); T.setdefault("snapshot", []).append((pc()-t0)/1e3)
                t0 = pc(); idx.refresh_layers(snap.copy()); T.setdefault("refresh", []).append((pc()-t0)/1e3)
                poffs = snap[:, SNAP_POFF].copy()
                t0 = pc(); b.cpu_marks.needing(poffs, 0, lay.layer_bytes); T.setdefault("needing", []).append((pc()-t0)/1e3)
            print(n, "  ".join(f"{k} {S.median(v):.1f}" for k, v in T.items()), flush=True)
            await b.evict(keys)
if os.environ.get("DETAIL"): asyncio.run(detail())
