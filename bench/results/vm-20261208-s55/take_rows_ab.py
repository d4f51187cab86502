"""In-process A/B of Allocator._take_rows: the committed one against a candidate, alternating."""
import os, time, statistics
import numpy as np
import tract_async as tract
from tract_async.engine import run
from tract_async.region.region import discard
from tract_async.stores.txn import PutTxn
from tract_async.region import alloc as A
from tract_async.keys import keys_to_words
LAY = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype="float16")
OLD = A.Allocator._take_rows
_take_runs = A._take_runs
Allocation = A.Allocation

def NEW(self, cls, nbytes, count):
    free_list = self._free[cls]
    chunks = self._chunks
    runs = []
    flat = []
    have = 0
    tail = (nbytes,)
    while have < count and free_list:
        c = chunks[free_list[-1]]
        cf = c.free
        nf = len(cf)
        if nf == 0:
            raise AssertionError("x")
        k = count - have
        if k >= nf:
            k = nf
            taken = cf[::-1]
            cf.clear()
            free_list.pop()
        else:
            taken = cf[nf - 1:nf - k - 1:-1]
            del cf[nf - k:]
        head = c.__dict__.get("run_head")
        if head is None:
            g = self.geo
            head = c.__dict__["run_head"] = (g.heap_off(c.index), g.chunk_off(c.index), c.slot_bytes, c.generation, c.token, self.node_id)
        runs.append((c.index, k, have, c.nslots - nf + k) + head + tail)
        flat += taken
        have += k
    out = np.empty((have, len(Allocation._fields)), dtype=np.int64)
    if not have:
        return out
    slots = np.array(flat, dtype=np.int64)
    st = int(_take_runs(self._region.mem, self._used_all, self._words_all,
                        np.array(runs, dtype=np.int64), slots, out))
    assert st >= 0
    return out

T = {"old": [], "new": []}
def timed(label, f):
    def w(*a, **k):
        t = time.perf_counter_ns()
        try: return f(*a, **k)
        finally: T[label].append(time.perf_counter_ns() - t)
    return w
async def main():
    path=f"/dev/shm/tract-tab-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=1200 << 20, create=True, node_id=0, layout=LAY, namespace="p", mode="transfer")
    try:
        async with tract.Engine.open(cfg) as eng:
            b = eng._store.blocks
            prev = None
            for r in range(400):
                lab = "old" if r % 2 else "new"
                A.Allocator._take_rows = timed(lab, OLD if lab == "old" else NEW)
                keys = eng.block_keys([r*100000+i for i in range(213*16)])
                st = PutTxn(b, keys, None, 5.0, "x", words=keys_to_words(keys))
                await st.begin()
                offs = np.sort(st.offsets())
                if prev is not None and r > 2:
                    pass
                await st.abandon()
            for k, v in T.items():
                v = v[20:]
                print(f"{k}: median {statistics.median(v)/1e3:.1f} us p10 {np.percentile(v,10)/1e3:.1f} (n={len(v)})")
    finally:
        discard(path)
if __name__ == "__main__":
    run(main())
