"""Helpers shared by the engine tests: a tiny layout, configs, and KV derived from keys."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

import tract_async as tract

TINY = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=32, dtype=torch.float32)


def cfg(path: str, node_id: int, *, create: bool = False, backend: str = "hw",
        layout: tract.KVLayout = TINY, region_bytes: int = 32 << 20, **kw) -> tract.EngineConfig:
    return tract.EngineConfig(layout=layout, region=path, region_bytes=region_bytes, create=create,
                              node_id=node_id, max_nodes=kw.pop("max_nodes", 8), namespace="tiny",
                              mem_backend=backend, heartbeat_interval_s=0.05,
                              liveness_timeout_s=kw.pop("liveness_timeout_s", 1.0),
                              chunk_bytes=kw.pop("chunk_bytes", 1 << 20), **kw)


def kv_for_keys(keys: list[bytes], layout: tract.KVLayout = TINY,
                layer: int | None = None) -> torch.Tensor:
    """KV whose every block is a pure function of its key (for exact checks across processes)."""
    per_block = []
    for k in keys:
        seed = int.from_bytes(hashlib.sha256(k).digest()[:8], "little")
        g = np.random.default_rng(seed)
        blk = g.standard_normal((layout.num_layers, 2, layout.block_tokens, layout.kv_heads,
                                 layout.head_dim)).astype(np.float32)
        per_block.append(torch.from_numpy(blk).to(layout.dtype))
    if not per_block:
        return torch.empty(layout.kv_shape(0, layer), dtype=layout.dtype)
    kv = torch.cat(per_block, dim=2)
    return kv if layer is None else kv[layer].contiguous()


def block_matches(keys: list[bytes], got: torch.Tensor, layout: tract.KVLayout = TINY,
                  layer: int | None = None) -> list[bool]:
    """Per block: do the bytes of ``got`` equal what ``kv_for_keys`` derives from the key?"""
    want = kv_for_keys(keys, layout, layer)
    T = layout.block_tokens
    out = []
    for j in range(len(keys)):
        if layer is None:
            out.append(torch.equal(got[:, :, j * T:(j + 1) * T], want[:, :, j * T:(j + 1) * T]))
        else:
            out.append(torch.equal(got[:, j * T:(j + 1) * T], want[:, j * T:(j + 1) * T]))
    return out
