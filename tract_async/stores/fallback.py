"""Region first, HTTP per transfer where the region cannot serve: the Engine's "region+http" store.

An engine with a region and HTTP configured (peers, or a secret to serve them) puts and gets
through the region, and falls back to its ``HttpStore`` for one transfer at a time when:

* ``region_full``: a put hits RegionFull (the region is all-or-nothing, so the whole batch goes to
  the HTTP pool; later layers of those blocks follow them there);
* ``foreign_rack``: a peer's hello named another region uuid (or none): it cannot see this
  region, so puts are also exported to the HTTP pool for it, and gets of blocks only a foreign
  peer holds READ them over HTTP.

(The third reason, ``attach``, is decided once at open: the whole engine then runs on HTTP.)
``fallbacks`` counts transfers by reason. Per key, a get reads from the region when the region
index has an entry for it, else over HTTP; a batch that spans both is split into runs.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import numpy as np

from .. import arrays
from . import waits
from ..errors import RegionFull, TransferTimeout
from .http import HttpStore
from ..keys import keys_to_words
from ..region.index import SNAP_SLOT
from .region import RegionStore


class FallbackStore:
    """put / get / lookup over a RegionStore with an HttpStore as per-transfer fallback."""

    def __init__(self, region: RegionStore, http: HttpStore, fallbacks: Counter[str]) -> None:
        self.region = region
        self.http = http
        self.layout = region.layout
        self.fallbacks = fallbacks
        self._spilled: set[bytes] = set()   # blocks being filled in the HTTP pool (region full)

    # -- lookup -------------------------------------------------------------------------------
    def _in_region(self, keys: list[bytes]) -> np.ndarray:
        return self.region.index.snapshot(keys_to_words(keys))[:, SNAP_SLOT] >= 0

    def lookup(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys):
            step = max(self.region.lookup(keys[n:]), self.http.lookup(keys[n:]))
            if step == 0:
                break
            n += step
        return n

    # -- put ----------------------------------------------------------------------------------
    async def put(self, keys: list[bytes], kv: Any, layer: int | None,
                  timeout: float | None) -> int:
        if any(k in self._spilled for k in keys):
            self.fallbacks["region_full"] += 1
            return await self._spill(keys, kv, layer, timeout)
        try:
            n = await self.region.put(keys, kv, layer, timeout)
        except RegionFull:
            self.fallbacks["region_full"] += 1
            return await self._spill(keys, kv, layer, timeout)
        if self.http.foreign_peers():
            self.fallbacks["foreign_rack"] += 1
            await self.http.put(keys, kv, layer, timeout)
        return n

    async def _spill(self, keys: list[bytes], kv: Any, layer: int | None,
                     timeout: float | None) -> int:
        n = await self.http.put(keys, kv, layer, timeout)
        for k in keys:
            b = self.http.pool.get(k)
            if b is not None and not b.complete:
                self._spilled.add(k)
            else:
                self._spilled.discard(k)
        return n

    # -- get ----------------------------------------------------------------------------------
    def _classify(self, keys: list[bytes]) -> list[str | None]:
        reg = self._in_region(keys)
        return ["r" if reg[i] else "h" if self.http.has(k) else None for i, k in enumerate(keys)]

    async def get(self, keys: list[bytes], out: Any, layer: int | None,
                  timeout: float | None) -> Any:
        loop = asyncio.get_running_loop()
        end = loop.time() + (timeout or 0.0)
        src = self._classify(keys)
        if None in src and timeout is not None and timeout > 0:
            src = await self._wait_sources(keys, end, timeout)
        src = [s or "r" for s in src]             # unknown: the region path reports the miss
        T = self.layout.block_tokens
        runs, s = [], 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or src[i] != src[s]:
                runs.append((s, i, src[s]))
                s = i
        for a, b, where in runs:
            left = None if timeout is None else max(0.0, end - loop.time())
            store = self.region if where == "r" else self.http
            before = self.http.stats.blocks_read_foreign
            if len(runs) == 1:
                await store.get(keys, out, layer, left)
            else:
                tmp = arrays.empty(self.layout.kv_shape(b - a, layer), self.layout.dtype_name)
                await store.get(keys[a:b], tmp, layer, left)
                if layer is None:
                    out[:, :, a * T:b * T] = tmp
                else:
                    out[:, a * T:b * T] = tmp
            if self.http.stats.blocks_read_foreign > before:
                self.fallbacks["foreign_rack"] += 1
        return out

    async def _wait_sources(self, keys: list[bytes], end: float, timeout: float) -> list[str | None]:
        """Wait until every key is known to the region or the HTTP directory: a region presence
        poll races a wait on HTTP directory events; whichever moves first, re-classify."""
        loop = asyncio.get_running_loop()
        while True:
            src = self._classify(keys)
            missing = [keys[i] for i, s in enumerate(src) if s is None]
            left = end - loop.time()
            if not missing:
                return src
            if left <= 0:
                raise TransferTimeout(f"blocks did not appear within {timeout} s")
            tasks = [asyncio.ensure_future(self._region_present(missing, left)),
                     asyncio.ensure_future(self._http_any(missing, left))]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.wait(tasks)

    async def _region_present(self, keys: list[bytes], left: float) -> None:
        r, g = self.region, self.region.geo
        stop = np.zeros(1, dtype=np.uint8)
        await waits.run_poll(waits.poll_present, waits.ThreadMem(r), g.entries_offset,
                             r.index.mask,
                             g.max_probe, g.lanes, keys_to_words(keys), waits.deadline_ns(left), stop)

    async def _http_any(self, keys: list[bytes], left: float) -> None:
        try:
            async with asyncio.timeout(left):
                while not any(self.http.has(k) for k in keys):
                    await self.http.wait_changed()
        except TimeoutError:
            pass

    # -- maintenance --------------------------------------------------------------------------
    async def maintain(self, timeout: float) -> None:
        errors: list[BaseException] = []
        for store in (self.region, self.http):
            try:
                await store.maintain(timeout)
            except Exception as e:  # noqa: BLE001 - run both, report the first
                errors.append(e)
        if errors:
            raise errors[0]

    def describe(self) -> dict[str, Any]:
        return self.http.describe()
