"""In-process A/B: begin -> early hook of 213 blocks, the committed reserve path against one
where an unsnapshotted put skips the all-absent rows and their scan, and _take_rows caches each
chunk's fixed run fields. Alternating per rep."""
import os, time, statistics
import numpy as np
import tract_async as tract
from tract_async.engine import run
from tract_async.region.region import discard
from tract_async.stores.txn import PutTxn
from tract_async.stores import reservation as R
from tract_async.region import alloc as A
from tract_async.keys import keys_to_words
import importlib.util, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); import take_rows_ab as take_ab  # noqa: E402 (its NEW)
LAY = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype="float16")
OLD_SNAP, OLD_RES, OLD_TAKE = R.Reserver.snapshot_for_put, R.Reserver.reserve, A.Allocator._take_rows
ABSENT = object()
def NEW_SNAP(self, words):
    n = words.shape[0]
    if n >= R.OPTIMISTIC_MIN_KEYS and self.puts_fresh:
        self.stats.unsnapshotted_puts += 1
        return None
    return self.index.snapshot(words)
async def NEW_RES(self, kb, snap, timeout):
    keys = kb.keys
    if snap is None and not self.book.reserved:
        new = list(range(len(keys)))
        skipped = self.stats.blocks_skipped
        await self._reserve_or_wait(kb, new, timeout)
        got = (new if self.placed == len(new) else [i for i in new if keys[i] in self.book.reserved])
        self.puts_fresh = self.stats.blocks_skipped == skipped
        return got
    if snap is None:
        snap = np.full((len(keys), R.SNAP_COLS), -1, dtype=np.int64)
    return await OLD_RES(self, kb, snap, timeout)
class Stamp:
    started = False
    def __init__(self): self.t = None
    def start(self, o): self.t = time.perf_counter_ns(); self.started = True
    def void(self): self.started = False
async def main():
    path=f"/dev/shm/tract-sab-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=1200 << 20, create=True, node_id=0, layout=LAY, namespace="p", mode="transfer")
    T = {"old": [], "new": []}
    try:
        async with tract.Engine.open(cfg) as eng:
            b = eng._store.blocks
            for r in range(400):
                lab = "old" if r % 2 else "new"
                if lab == "old":
                    R.Reserver.snapshot_for_put, R.Reserver.reserve, A.Allocator._take_rows = OLD_SNAP, OLD_RES, OLD_TAKE
                else:
                    R.Reserver.snapshot_for_put, R.Reserver.reserve, A.Allocator._take_rows = NEW_SNAP, NEW_RES, take_ab.NEW
                keys = eng.block_keys([r*100000+i for i in range(213*16)])
                h = Stamp()
                t0 = time.perf_counter_ns()
                txn = PutTxn(b, keys, None, 5.0, "x", early=h)
                await txn.begin()
                assert len(txn.todo) == 213
                await txn.abandon()
                if r >= 40:
                    assert h.t is not None
                    T[lab].append(h.t - t0)
    finally:
        discard(path)
    for k, v in T.items():
        print(f"{k}: begin -> hook median {statistics.median(v)/1e3:.1f} us, p10 {np.percentile(v,10)/1e3:.1f} (n={len(v)})")
run(main())
