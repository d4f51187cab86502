"""Worker processes for the NIXL engine tests (spawned; importable)."""
from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np

import tract_async as tract
from tests.support.engine_http_util import http_cfg
from tests.support.engine_util import kv_for_keys


def producer(q_out: Any, q_in: Any, pool_bytes: int) -> None:
    """A NIXL engine that stores what it is told to and serves it until told to leave (or
    killed). Commands: ("put", token_ids) all layers, ("layer", token_ids, i) one layer,
    ("fill", first_token, nblocks) many blocks, ("exit",). Each is answered on ``q_out``."""
    async def main() -> None:
        cfg = http_cfg(0, transport="nixl", region_bytes=pool_bytes, http_pool_bytes=pool_bytes)
        async with tract.Engine.open(cfg) as eng:
            q_out.put(("up", eng.url, os.getpid()))
            loop = asyncio.get_running_loop()
            while True:
                cmd = await loop.run_in_executor(None, q_in.get)
                if cmd[0] == "exit":
                    break
                if cmd[0] == "put":
                    keys = eng.block_keys(cmd[1])
                    q_out.put(("put", await eng.put_kv(keys, kv_for_keys(keys)), 0))
                elif cmd[0] == "layer":
                    keys = eng.block_keys(cmd[1])
                    kv = kv_for_keys(keys, layer=cmd[2])
                    q_out.put(("layer", await eng.put_kv(keys, kv, layer=cmd[2]), cmd[2]))
                elif cmd[0] == "fill":
                    start, n = cmd[1], cmd[2]
                    keys = eng.block_keys(range(start, start + n * 16))
                    kv = kv_for_keys(keys[:1]).repeat(1, 1, n, 1, 1)    # one block's bytes, n times
                    q_out.put(("fill", await eng.put_kv(keys, kv), 0))
            st = eng.stats()
            q_out.put(("bye", st["blocks_stored"], st["nixl"]["reads"]))
    tract.run(main())


def nixl_target(q_out: Any, nbytes: int) -> None:
    """A bare NixlAgent serving ``nbytes`` of 0xAB until killed (the peer-death test)."""
    async def main() -> None:
        from tract_async.transport.nixl_agent import NixlAgent
        agent = NixlAgent("target")
        src = np.full(nbytes, 0xAB, dtype=np.uint8)
        info = agent.register_memory(src, name="src", writable=False)
        await agent.start()
        q_out.put((agent.get_agent_metadata(), info.addr, os.getpid()))
        agent.keep_hot(600.0)                 # serve promptly: the test measures no latency
        await asyncio.Event().wait()
    asyncio.run(main())
