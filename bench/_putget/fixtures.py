"""What every part of ``bench/putget.py`` measures with: the KV layout, engine configs, tensors and
keys, /dev/shm paths, the torch baseline's mapping and the timing loops.

All three parts use the same 64 KiB block (4 layers x K,V x 16 tokens x 4 kv heads x 64 x bf16:
8 rows of 8 KiB) so that their figures compare; the assertion below keeps it so.
"""
from __future__ import annotations

import gc
import hashlib
import mmap
import os
import time
from typing import Awaitable, Callable

import numpy as np
import torch

import tract_async as tract
import tract_kernels as K

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=4, head_dim=64,
                        dtype=torch.bfloat16)
BLOCK = LAYOUT.block_bytes
assert BLOCK == 64 * KiB, BLOCK
S_BENCH = K.site("bench.putget")
# torch's default at start-up: part 1 drops to one thread for a baseline and restores this
TORCH_THREADS = torch.get_num_threads()
# added to the payload a part plans to hold when it sizes a region: the engine's index, chunk
# and node tables live in the region too; a producer counts only the rest as room for its blocks
REGION_OVERHEAD = 96 * MiB
SHM_DIR = "/dev/shm"
REGION_DIR_ENV = "TRACT_BENCH_REGION_DIR"
"""``--region-dir`` of ``bench/putget.py``, in the environment so that the handoff's child
processes put their region there too; unset or empty: ``SHM_DIR``. A hugetlbfs mount gives the
region (and the torch baseline's mapping) 2 MiB pages, as a devdax mapping of CXL memory has."""
HUGE_ALIGN = 2 * MiB


def region_dir() -> str:
    """Where this run's regions and baseline mappings live (``REGION_DIR_ENV``)."""
    return os.environ.get(REGION_DIR_ENV) or SHM_DIR


def shm_path(tag: str) -> str:
    """A path of this run in ``region_dir()``: ``leftovers()`` finds (and the watchdog removes)
    every one."""
    return f"{region_dir()}/{_shm_prefix()}{tag}"


def _shm_prefix() -> str:
    return f"tract-bench-{os.getpid()}-"


def leftovers() -> list[str]:
    """Names of this run's files still in ``region_dir()`` (a part that died before its
    cleanup)."""
    return [f for f in os.listdir(region_dir()) if f.startswith(_shm_prefix())]


def remove_leftovers() -> list[str]:
    """Unlink this run's /dev/shm files; returns their names."""
    left = leftovers()
    for f in left:
        os.unlink(os.path.join(region_dir(), f))
    return left


COPY_THREADS_ENV = "TRACT_BENCH_COPY_THREADS"
"""``--copy-threads`` of ``bench/putget.py``, in the environment so that the handoff's child
processes build the same EngineConfig; unset or empty: None (the engine sizes it from the host)."""


def copy_threads() -> int | None:
    """``EngineConfig.copy_threads`` for every engine of the run (``COPY_THREADS_ENV``)."""
    v = os.environ.get(COPY_THREADS_ENV, "")
    return int(v) if v else None


def copy_threads_used() -> int:
    """The threads a large copy runs on in this run (None resolved as the engine does)."""
    from tract_async.stores.cpucopy import auto_copy_threads
    n = copy_threads()
    return auto_copy_threads() if n is None else n


def engine_cfg(path: str, node_id: int, region_bytes: int, create: bool) -> tract.EngineConfig:
    """The hw backend on a /dev/shm region: what the figures are about (not the sim model)."""
    return tract.EngineConfig(layout=LAYOUT, region=path, region_bytes=region_bytes, create=create,
                              node_id=node_id, namespace="bench-putget", mem_backend="hw",
                              copy_threads=copy_threads())


def make_kv(nblocks: int, salt: int = 0) -> torch.Tensor:
    """A KV tensor of ``nblocks`` blocks, every page touched, content not constant."""
    kv = torch.empty(LAYOUT.kv_shape(nblocks), dtype=LAYOUT.dtype)
    w = kv.view(-1).view(torch.int64)
    torch.arange(w.numel(), dtype=torch.int64, out=w)
    w.mul_(0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF).add_(salt)
    return kv


def rand_keys(n: int) -> list[bytes]:
    """Fresh keys: a put of them never hits a resident block."""
    return [os.urandom(32) for _ in range(n)]


def det_keys(label: str, i: int, n: int) -> list[bytes]:
    """Keys both processes of a handoff derive alike."""
    return [hashlib.sha256(f"{label}/{i}/{j}".encode()).digest() for j in range(n)]


class Mapping:
    """A plain file mapping in ``region_dir()`` for the torch baseline (prefaulted, unlinked on
    close). The file is whole 2 MiB pages (a hugetlbfs file must be); the views are ``nbytes``."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        size = -(-nbytes // HUGE_ALIGN) * HUGE_ALIGN
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.np = np.frombuffer(self.mm, dtype=np.uint8, count=nbytes)
        self.np[:] = 1
        self.t = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.mem = K.make_mem(self.np, "hw")

    def close(self) -> None:
        # the views must go before the mmap can close (it refuses while buffers are exported)
        del self.t, self.np, self.mem
        gc.collect()
        try:
            self.mm.close()
        finally:
            os.unlink(self.path)


def timeit(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls (samples, not a summary: the JSON keeps them)."""
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t) / 1e9)
    return out


async def atimeit(fn: Callable[[], Awaitable[object]], reps: int) -> list[float]:
    """``timeit`` for a coroutine function."""
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        await fn()
        out.append((time.perf_counter_ns() - t) / 1e9)
    return out
