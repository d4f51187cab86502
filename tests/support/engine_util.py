"""Helpers shared by the engine tests: a tiny layout, configs, and KV derived from keys.

KV comes as torch tensors by default, or as numpy arrays with ``as_numpy=True``: the spawned
workers of the cross-process tests move numpy arrays and never import torch (``import torch``
costs ~2 s of CPU on the 2-core VM, and the crash-point test and the soak spawn dozens of
processes). ``block_matches`` takes either kind.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import tract_async as tract
from tract_async import arrays

TINY = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=32, dtype="float32")


def cfg(path: str, node_id: int, *, create: bool = False, backend: str = "hw",
        layout: tract.KVLayout = TINY, region_bytes: int = 32 << 20, **kw) -> tract.EngineConfig:
    return tract.EngineConfig(layout=layout, region=path, region_bytes=region_bytes, create=create,
                              node_id=node_id, max_nodes=kw.pop("max_nodes", 8),
                              namespace=kw.pop("namespace", "tiny"),
                              mem_backend=backend, heartbeat_interval_s=0.05,
                              liveness_timeout_s=kw.pop("liveness_timeout_s", 1.0),
                              chunk_bytes=kw.pop("chunk_bytes", 1 << 20), **kw)


def free_slots(eng: tract.Engine, layout: tract.KVLayout = TINY) -> int:
    """Block slots this engine holds free: its allocator's free lists and its spares."""
    st = eng._store.blocks
    return st.alloc.free_slots(layout.block_bytes) + len(st.spares)


def _block(key: bytes, layout: tract.KVLayout) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    g = np.random.default_rng(seed)
    return g.standard_normal((layout.num_layers, 2, layout.block_tokens, layout.kv_heads,
                              layout.head_dim)).astype(np.float32)


def kv_for_keys(keys: list[bytes], layout: tract.KVLayout = TINY,
                layer: int | None = None, *, as_numpy: bool = False) -> Any:
    """KV whose every block is a pure function of its key (for exact checks across processes):
    a torch tensor of the layout's dtype, or (``as_numpy``; float32 layouts) a numpy array."""
    if as_numpy:
        if layout.dtype_name != "float32":
            raise ValueError("as_numpy=True needs a float32 layout")
        kv = (np.concatenate([_block(k, layout) for k in keys], axis=2) if keys
              else np.empty(layout.kv_shape(0), dtype=np.float32))
        return kv if layer is None else np.ascontiguousarray(kv[layer])
    import torch
    per_block = [torch.from_numpy(_block(k, layout)).to(layout.dtype) for k in keys]
    if not per_block:
        return torch.empty(layout.kv_shape(0, layer), dtype=layout.dtype)
    kv = torch.cat(per_block, dim=2)
    return kv if layer is None else kv[layer].contiguous()


def np_out(keys: list[bytes], layout: tract.KVLayout = TINY, layer: int | None = None
           ) -> np.ndarray:
    """A numpy ``out`` for ``get_kv`` (without one, get_kv returns a torch tensor where torch is
    installed, and imports it)."""
    return np.empty(layout.kv_shape(len(keys), layer), dtype=arrays.NUMPY_STORAGE[layout.dtype_name])


def block_matches(keys: list[bytes], got: Any, layout: tract.KVLayout = TINY,
                  layer: int | None = None) -> list[bool]:
    """Per block: do the bytes of ``got`` (a tensor or a numpy array) equal what
    ``kv_for_keys`` derives from the key?"""
    T = layout.block_tokens
    if not arrays.is_tensor(got):
        want = kv_for_keys(keys, layout, layer, as_numpy=True)
        if layer is None:
            return [bool(np.array_equal(got[:, :, j * T:(j + 1) * T], want[:, :, j * T:(j + 1) * T]))
                    for j in range(len(keys))]
        return [bool(np.array_equal(got[:, j * T:(j + 1) * T], want[:, j * T:(j + 1) * T]))
                for j in range(len(keys))]
    import torch
    want = kv_for_keys(keys, layout, layer)
    out = []
    for j in range(len(keys)):
        if layer is None:
            out.append(torch.equal(got[:, :, j * T:(j + 1) * T], want[:, :, j * T:(j + 1) * T]))
        else:
            out.append(torch.equal(got[:, j * T:(j + 1) * T], want[:, j * T:(j + 1) * T]))
    return out


async def until(pred: Any, timeout: float = 3.0) -> bool:
    """Poll ``pred()`` every 10 ms until it is true or ``timeout`` passes; its last value."""
    import asyncio
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return bool(pred())
