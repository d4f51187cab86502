import asyncio, os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import numpy as np, torch
import tract_async as tract
from tract_async.keys import keys_to_words
from tract_async.stores import fused
from tract_async import crashpoints as CP
from _putget.fixtures import BLOCK, det_keys, engine_cfg, make_kv, REGION_OVERHEAD
async def main():
    path = f"/dev/shm/tract-d-{os.getpid()}"
    reps = 3000
    try:
      async with tract.Engine.open(engine_cfg(path, 0, (reps + 200) * BLOCK + REGION_OVERHEAD, True)) as eng:
        self = eng._store.blocks; tmpl = eng._store._template(1); kv = make_kv(1); src = kv.data_ptr()
        acc = np.zeros(8); await eng.put_kv(det_keys("w", 0, 1), kv); await asyncio.sleep(0.2); fb = 0; cnt = 0
        for i in range(reps):
            keys = det_keys("a", i, 1); words = keys_to_words(keys); await asyncio.sleep(0)
            p = time.perf_counter_ns
            t = [p()]
            n = len(keys)
            if (not self._lane_ready or CP.ARMED
                    or (self._reserved and any(k in self._reserved for k in keys))
                    or not self._give_check_passes()):
                fb += 1; await eng.put_kv(keys, kv); continue
            t.append(p())
            if len(self._spares) < n and not self._refill_spares(n):
                fb += 1; await eng.put_kv(keys, kv); continue
            t.append(p())
            c = len(self._spares)
            res = self._fres[:n]
            now = time.time_ns()
            deadline = (now + int(self.cfg.transfer_deadline_s * 1e9) if self.cfg.mode == "transfer" else 0)
            info = self._spare_info[c - n:c]; s64 = np.uint64(src)
            t.append(p())
            st = int(fused.put_blocks(self.mem, self._fp, self.index.tgeo, words, info, tmpl, s64, now, deadline, res))
            t.append(p())
            rows = res.tolist()
            used = [j for j in range(n) if rows[j][0] >= 0]
            if len(used) == n:
                del self._spares[c - n:]
            t.append(p())
            self.stats.lockfree_reservations += 1
            k = len(used)
            self.stats.blocks_skipped += n - k
            self.stats.blocks_stored += k
            self.stats.bytes_put += k * self.layout.block_bytes
            self.stats.puts += 1
            self.stats.fused_puts += 1
            if st:
                self.doorbell.ring(st)
            t.append(p())
            if i > 100:
                cnt += 1; acc[:len(t)-1] += np.diff(t)
        print("fallbacks", fb, self._lane_ready, CP.ARMED, len(self._reserved)); m = acc / max(1, cnt) / 1e3
        print("checks %.2f spares %.2f prep %.2f kernel %.2f post %.2f stats %.2f" % tuple(m[:6]), "refills", )
    finally:
        if os.path.exists(path): os.unlink(path)
asyncio.run(main())
