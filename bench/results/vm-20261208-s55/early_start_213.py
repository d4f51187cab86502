"""How much of a whole prompt's reservation now precedes its copies (session 55, the VM).

PutTxn.begin of 213 new Llama-3-8B blocks (2 MiB each), lock-free (the slots on this node's
free lists), 120 times on fresh keys, each abandoned after: with an ``EarlyCopies`` hook that
only stamps the time it is called (the CUDA back-end enqueues its copies there), and without.
Prints the medians: begin -> the hook (what now precedes the first copy), begin's whole time
with and without the hook (before this change the copies started after all of it).
Run: python bench/results/vm-20261208-s55/early_start_213.py
"""
import os
import statistics
import time

import numpy as np

import tract_async as tract
from tract_async.engine import run
from tract_async.keys import keys_to_words
from tract_async.region.region import discard
from tract_async.stores.txn import PutTxn

LAY = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128, dtype="float16")
N = 213


class Stamp:
    started = False

    def __init__(self) -> None:
        self.t: int | None = None

    def start(self, offsets: np.ndarray) -> None:
        self.t = time.perf_counter_ns()
        self.started = True

    def void(self) -> None:
        self.started = False


async def main() -> None:
    path = f"/dev/shm/tract-early-{os.getpid()}"
    cfg = tract.EngineConfig(region=path, region_bytes=1200 << 20, create=True, node_id=0,
                             layout=LAY, namespace="e", mode="transfer")
    try:
        async with tract.Engine.open(cfg) as eng:
            b = eng._store.blocks
            to_hook, whole_on, whole_off = [], [], []
            for r in range(240):
                keys = eng.block_keys([r * 100000 + i for i in range(N * 16)])
                words = keys_to_words(keys)
                hook = Stamp() if r % 2 == 0 else None
                t0 = time.perf_counter_ns()
                txn = PutTxn(b, keys, None, 5.0, "bench", words=words, early=hook)
                await txn.begin()
                t1 = time.perf_counter_ns()
                await txn.abandon()
                if r < 40:
                    continue
                if hook is None:
                    whole_off.append(t1 - t0)
                else:
                    assert hook.t is not None, "the reservation did not call the hook"
                    to_hook.append(hook.t - t0)
                    whole_on.append(t1 - t0)
            med = lambda xs: statistics.median(xs) / 1e3  # noqa: E731
            print(f"{N} blocks, {len(to_hook)} + {len(whole_off)} reps (alternating):")
            print(f"  begin -> early hook (precedes the copies now): {med(to_hook):.1f} us")
            print(f"  begin, whole, with the hook:                  {med(whole_on):.1f} us")
            print(f"  begin, whole, without (preceded them before): {med(whole_off):.1f} us")
            print(f"  stats: early_copies {eng._store.stats.early_copies}")
    finally:
        discard(path)


run(main())
