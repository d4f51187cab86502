"""Engine put/get throughput, cross-process handoff against real NIXL, lookup and block_keys rates.

One run, one machine (issue 4). Three parts, each against a baseline measured in the same run:

1. ``put_kv`` / ``get_kv`` GB/s of one Engine (hw backend, a /dev/shm region) against torch
   ``copy_`` into / out of a /dev/shm mapping, 64 KiB .. 256 MiB, KVLayout with 64 KiB blocks
   (4 layers x K,V x 16 tokens x 4 kv heads x 64 x bf16: 8 rows of 8 KiB per block). Puts use
   fresh keys every repetition (timed end to end: snapshot, global lock, reservation, copy,
   publish); gets re-read resident keys into a preallocated ``out``. A second, instrumented pass
   splits the time into phases (lock wait, reservation, copy kernel, the rest). Target >= 0.9x.
2. Handoff between two processes: A ``put_kv``; B's ``get_kv(keys, timeout=...)``, started before,
   returns. A stamps ``perf_counter_ns()`` just before ``put_kv``, B when ``get_kv`` returned
   (CLOCK_MONOTONIC: one clock for both). 64 KiB (p50/p99 over hundreds) and 16/64/128 MiB
   (bandwidth = bytes / handoff). Against NIXL 1.5.1 from PyPI between two processes, DRAM to
   DRAM, progress thread off, UCX shm (``shm,cma,tcp``) and UCX TCP, WRITE with notification
   (``bench/_nixl.py`` says why that is the faithful and strongest equivalent). Targets: 64 KiB
   p50 <= 0.5x NIXL's; 16-128 MiB bandwidth >= 1.2x NIXL's.
3. ``lookup`` keys/s (one call = a batch of 1024 resident keys; target >= 1M keys/s) and
   ``block_keys`` keys/s.

Floors, written before measuring (the run measures the memcpy they use and prints them):
  * put of S bytes: S / (DRAM write bandwidth). The payload goes out with non-temporal stores so
    it is in memory when put returns (it must be, on non-coherent CXL memory); torch ``copy_`` of
    a cache-resident size (64 KiB .. 16 MiB on this VM) never leaves the cache, so it is not a
    memory number. Floor column: S / private->private memcpy of S bytes (the brief's "plain
    memcpy"), which equals the cache speed at small sizes and DRAM speed at 256 MiB.
  * get of S bytes: every line is invalidated first, so it reads DRAM even when the bytes were
    cached: floor = S / (DRAM read bandwidth) + invalidate cost (~1.4 ns/line).
  * handoff of S bytes: put then get, serially (a whole-block get waits for READY): floor =
    S/write_bw + S/read_bw; with layer streaming the consumer reads layer l while the producer
    writes l+1, floor ~ max of the two plus one layer. NIXL over shm (CMA) copies once.
  * lookup: one forced DRAM miss (invalidate + mfence + load) per key, serialised by the fence:
    ~300-400 ns (kernels.json), floor ~2.5-3M keys/s. block_keys: one SHA-256 over canonical
    CBOR per block (vLLM's sha256_cbor), a few microseconds of Python per block.

Predictions, written before the full run (a 200-put prototype showed 127 us per 64 KiB put and
44 us per get, lock wait p50 30 us): put/torch ~0.02-0.05x at 64 KiB (a fixed ~100 us of lock,
reservation and Python against a 2 us cached copy), ~0.2x at 1 MiB, ~0.5-0.8x at 16 MiB, ~1-1.5x
at 256 MiB (NT stores skip the read-for-ownership torch pays at DRAM sizes). get/torch ~0.03x,
~0.1x, ~0.3x, ~0.6x (the invalidate forces DRAM reads; kernel-level read/torch was 0.70 at
256 MiB). Handoff 64 KiB: put + consumer wake-up + get ~0.2-0.6 ms against NIXL shm ~30-50 us:
target missed ~10x. Handoff 128 MiB: ~S/30 + S/15 GB/s ~ 13 ms, ~10 GB/s: ~1x NIXL shm (one CMA
copy, ~9 GB/s), ~7x NIXL TCP; layer streaming a little better. lookup: Python key checks +
~350 ns/key jitted: ~1.2-1.5M keys/s. block_keys: ~100-200k keys/s.

Findings (runs of 2026-11-30 02:27-02:39, load 1.7-5; every target but lookup missed):
  * put copy: the NT kernel reaches 20-42 GB/s alone, but copy_in issues write_bytes per 8 KiB
    row, each ending in sfence (+2 clflushopt): 2.0-2.8x slower than one sfence per call
    (standalone, 256 blocks: 13.8 -> 38.1 GB/s; copy_out with invalidate+mfence per row 7.1 ->
    17.5 GB/s when all rows are invalidated first, one mfence, then copied).
  * Region.attach maps without MAP_POPULATE (MADV_WILLNEED only): first touch of every page of an
    attached region faults; put copy ran at 2.5-3.0 GB/s on re-attached regions vs 8-12 GB/s
    on created ones (same bench, two runs). Every non-creator node (the handoff producer) pays it.
  * reservation under the lock: ~30-35 us per block (alloc_nowait's _write_heap_word with
    np.packbits + 5 kernel dispatches, a reservation per block, a per-block index.snapshot for the version):
    138 ms of a 183 ms 256 MiB put; 7.3 ms of a 10 ms 16 MiB put.
  * lock wait: 20 us p50 while the manager is in its spin phase, 130-850 us once it has backed
    off (usleep up to 500 us); the handoff producer waits 200 us - 25 ms at 64-128 MiB.
  * get: snapshot ~1.5 us/key (two invalidate+mfence per key), per-row invalidate+mfence copy at
    6-7 GB/s, ~3 us/block of Python after the copy (payload checks, touches).
  * handoff: the consumer wakes through two thread polls (present, then layers) with backoff to
    500 us; after the put returns it still needs ~380 us at 64 KiB.
  * an intermittent hang in Engine close/open (loop idle, no heartbeat thread) was hit twice.

Usage: ``python bench/putget.py [--quick] [--no-nixl] [--parts 123] [--copy-threads N]``
(``--copy-threads``: ``EngineConfig.copy_threads`` of every engine; default None, from the
host; the table headers and the JSON say which). Writes
``bench/results/putget-<time>-<commit>.json`` (machine details included). Regions are
``/dev/shm/tract-bench-<pid>-*`` and are removed on exit. After the run, the "Findings" printed
at the end say where the time goes; the JSON carries every sample. The parts live in
``bench/_putget/`` (its ``__init__`` lists the modules); this file is the command line.
"""
from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import _nixl  # noqa: E402

import tract_async as tract  # noqa: E402
from tract_async.region.region import backing_info  # noqa: E402

from _putget import report  # noqa: E402
from _putget.fixtures import (BLOCK, COPY_THREADS_ENV, KiB, LAYOUT, MiB,  # noqa: E402
                              REGION_DIR_ENV, TORCH_THREADS, copy_threads_used, region_dir,
                              remove_leftovers)
from _putget.handoff import part_handoff  # noqa: E402
from _putget.lookup import part_keys  # noqa: E402
from _putget.throughput import part_putget  # noqa: E402


def start_watchdog(deadline_s: float) -> None:
    """A hang must not leave regions behind or a silent process: after ``deadline_s`` dump all
    stacks, remove this run's /dev/shm files and exit 3 (children are daemons: they die too)."""
    def fire() -> None:
        print(f"\nputget: still running after {deadline_s:.0f} s; stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for c in mp.active_children():
            c.kill()
        remove_leftovers()
        os._exit(3)
    t = threading.Timer(deadline_s, fire)
    t.daemon = True
    t.start()


def loadavg() -> list[str]:
    """The 1, 5 and 15 minute load averages: a busy machine explains a slow run."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes up to 16 MiB, fewer samples (<1 min)")
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument("--parts", default="123")
    ap.add_argument("--deadline-s", type=float, default=600.0,
                    help="dump every thread's stack, remove our regions and exit after this long")
    ap.add_argument("--copy-threads", type=int, default=None, metavar="N",
                    help="EngineConfig.copy_threads of every engine (default: from the host)")
    ap.add_argument("--region-dir", default=None, metavar="DIR",
                    help="where regions and the torch baseline's mapping live (default /dev/shm; "
                         "a hugetlbfs mount gives them 2 MiB pages, as a devdax mapping has)")
    args = ap.parse_args()
    if args.region_dir is not None:
        if not os.path.isdir(args.region_dir):
            ap.error(f"--region-dir {args.region_dir}: not a directory")
        os.environ[REGION_DIR_ENV] = args.region_dir
    if args.copy_threads is not None and args.copy_threads < 1:
        ap.error("--copy-threads must be >= 1")
    # in the environment: the handoff's child processes build their engines from it too
    os.environ[COPY_THREADS_ENV] = "" if args.copy_threads is None else str(args.copy_threads)
    threads_used = copy_threads_used()
    t_start = time.monotonic()
    start_watchdog(args.deadline_s)
    sizes = [64 * KiB, MiB, 16 * MiB] if args.quick else [64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    load_before = loadavg()
    print(f"load average before: {' '.join(load_before)}; torch threads {TORCH_THREADS}; "
          f"block {BLOCK} B; regions in {region_dir()} ({backing_info(region_dir()).kind}); "
          f"copy threads {threads_used}"
          f"{' (from the host)' if args.copy_threads is None else ''}", flush=True)
    out: dict[str, Any] = {"quick": args.quick, "layout": {
        "num_layers": LAYOUT.num_layers, "block_tokens": LAYOUT.block_tokens,
        "kv_heads": LAYOUT.kv_heads, "head_dim": LAYOUT.head_dim, "dtype": "bfloat16",
        "block_bytes": BLOCK}, "backend": "hw", "torch_threads": TORCH_THREADS,
        "nixl": _nixl.version(), "load_before": load_before,
        "region_dir": {"path": region_dir(), "backing": backing_info(region_dir()).kind},
        "copy_threads": {"asked": args.copy_threads, "used": threads_used,
                         "cpu_count": os.cpu_count()}}
    try:
        if "1" in args.parts:
            print("part 1: put/get vs torch copy_ ...", flush=True)
            out["putget"] = tract.run(part_putget(sizes, args.quick))
            out["putget"]["copy_threads"] = threads_used
            report.print_putget(out["putget"])
        if "2" in args.parts:
            print("\npart 2: handoff between two processes ...", flush=True)
            out["handoff"] = part_handoff(args.quick, not args.no_nixl)
            report.print_handoff(out["handoff"])
        if "3" in args.parts:
            print("\npart 3: lookup and block_keys ...", flush=True)
            out["keys"] = tract.run(part_keys(args.quick))
            report.print_keys(out["keys"])
        out["verdicts"] = report.verdicts(out)
        print("\ntargets")
        for v in out["verdicts"]:
            print(f"  {v}")
    finally:
        out["load_after"] = loadavg()
        out["wall_s"] = time.monotonic() - t_start
        out["shm_leftovers_removed"] = remove_leftovers()
    # a quick run does not replace the full run's file, which the README cites
    path = C.write_json("putget-quick" if args.quick else "putget", out)
    print(f"\nwall {out['wall_s']:.0f} s; load average after: {' '.join(out['load_after'])}; "
          f"wrote {path}")


if __name__ == "__main__":
    main()
