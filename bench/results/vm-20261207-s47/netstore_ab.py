import asyncio, statistics, sys, time, json
sys.path.insert(0, sys.argv[1])
import tract_async as tract
sys.path.insert(0, sys.argv[1])
from tests.support.engine_http_util import http_pair
from tests.support.engine_util import kv_for_keys

async def main():
    a, b = await http_pair(transport=sys.argv[2], region_bytes=256 << 20)
    res = {}
    try:
        for nblk in (1, 8, 64):
            pt, gl, gr = [], [], []
            for it in range(60):
                keys = b.block_keys(range(it * 10000, it * 10000 + 16 * nblk))
                kv = kv_for_keys(keys)
                t = time.perf_counter(); await b.put_kv(keys, kv); pt.append(time.perf_counter() - t)
                t = time.perf_counter(); await b.get_kv(keys); gl.append(time.perf_counter() - t)
                t = time.perf_counter(); await a.get_kv(keys); gr.append(time.perf_counter() - t)
                await b.evict(keys) if hasattr(b, "evict") else None
            res[nblk] = [round(statistics.median(x) * 1e6) for x in (pt, gl, gr)]
    finally:
        await b.close(); await a.close()
    print(sys.argv[2], sys.argv[1].split('/')[-1], res)
asyncio.run(main())
