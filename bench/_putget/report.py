"""The printed side of ``bench/putget.py``: each part's tables and the verdict on every target.

Only formatting: everything here reads the result dict that goes into the JSON, so what is
printed is what was recorded.
"""
from __future__ import annotations

import os
from typing import Any

import _common as C

from _putget.fixtures import KiB, MiB


def print_putget(p1: dict[str, Any]) -> None:
    print(f"\nput/get, GB/s, copy threads {p1.get('copy_threads', '?')} (medians; torch = the "
          "better of its default threads and 1 thread; floor = bytes / private memcpy of the "
          "same size)")
    print(C.table(p1["rows"], ["size", "reps", "put_GBps", "torch_put_GBps", "put/torch",
                               "get_GBps", "torch_get_GBps", "get/torch", "memcpy_GBps",
                               "put_us", "get_us", "put_floor_us"]))
    print("\nsame sizes, other baselines, GB/s: bytes made to reach memory (torch+flush), "
          "read from memory (invalidate+torch), the bare kernels, torch on one thread")
    print(C.table(p1["rows"], ["size", "torch_put+flush_GBps", "nt_write_kernel_GBps",
                               "torch_put_default_GBps", "torch_put_1thr_GBps",
                               "inval+torch_get_GBps", "inval_read_kernel_GBps",
                               "torch_get_default_GBps", "torch_get_1thr_GBps",
                               "evictions_during_puts"]))
    print("\nwhere the time goes (instrumented pass, median us of each phase over the calls)")
    print(C.table(p1["phases"], ["size", "op", "total_us", "lock_wait_us", "reserve_held_us",
                                 "snapshot_us", "copy_kernel_us", "copy_hop_us", "fused_us",
                                 "staged_us", "parallel_us", "other_us",
                                 "copy_only_GBps", "lock_wait_p50_us"]))
    if any(r.get("staged_us") for r in p1["phases"]):
        print("staged_us: the wall time of a staged put's stages (stores/region.py, \"Staged "
              "large puts\"); its reservation, snapshot and copy columns overlap there and do "
              "not add up; other_us is then total - staged_us")
    if any(r.get("parallel_us") for r in p1["phases"]):
        print("parallel_us: the wall time of a parallel read's groups (stores/parallel.py), "
              "each group's snapshot, copy and revalidation on its own thread")
    for k, v in p1.items():
        if k.startswith("fixed_pieces"):
            print(f"{k}: " + ", ".join(f"{a} {b:.1f}" for a, b in v.items()))


def print_handoff(p2: dict[str, Any]) -> None:
    print("\nhandoff (A stamps before put_kv / NIXL WRITE; B stamps when get_kv returned / "
          "the notification arrived)")
    print(C.table(p2["rows"], ["case", "n", "consumer_waits_ms", "eng_p50_us", "eng_p99_us",
                               "eng_GBps", "eng_put_p50_us", "eng_after_put_p50_us",
                               "eng_lock_wait_p50_us", "eng_wake_p50_us",
                               "shm_p50_us", "shm_p99_us", "shm_GBps", "tcp_p50_us",
                               "tcp_p99_us", "tcp_GBps", "eng/shm_time", "eng/tcp_time"]))
    for k, v in p2["not_measured"].items():
        print(f"{k}: not measured: {v}")


def print_keys(p3: dict[str, Any]) -> None:
    print(C.table(p3["rows"], ["op", "keys", "us_per_call", "ns_per_key", "Mkeys_per_s"]))


def _met(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def verdicts(out: dict[str, Any]) -> list[str]:
    """One line per target of issue 13: a 64 KiB handoff p50 <= NIXL shm's (<= 2x on a host of
    at most 2 cores); 16-128 MiB >= 1.5x NIXL shm's bandwidth; put and get >= 0.5x torch
    ``copy_`` at 256 MiB (smaller sizes reported against the same bar, not targets); a
    doorbell wake-up <= 20 us p50 after the publication; lookup >= 1 M keys/s (issue 4)."""
    v = []
    two_cores = (os.cpu_count() or 1) <= 2
    for r in out.get("putget", {}).get("rows", []):
        for op in ("put", "get"):
            x = r[f"{op}/torch"]
            tag = "target >= 0.5" if r["bytes"] >= 256 * MiB else "not a target; bar 0.5"
            v.append(f"{op} {r['size']}: {x:.2f}x torch copy_ ({tag}): {_met(x >= 0.5)}")
    for r in out.get("handoff", {}).get("rows", []):
        if r.get("eng_wake_p50_us") is not None:
            w = r["eng_wake_p50_us"]
            v.append(f"wake-up {r['case']}: publish -> doorbell p50 {w:.1f} us, p99 "
                     f"{r['eng_wake_p99_us']:.1f} us, {r['eng_not_bell_woken']} of {r['n']} "
                     f"not woken by the last publish's ring (target p50 <= 20 us): {_met(w <= 20)}")
        if "eng/shm_time" not in r:
            continue
        x = r["eng/shm_time"]
        if r["bytes"] <= 64 * KiB:
            bar = 2.0 if two_cores else 1.0
            v.append(f"handoff {r['case']}: engine p50 {r['eng_p50_us']:.0f} us vs NIXL shm "
                     f"{r['shm_p50_us']:.0f} us = {x:.2f}x (target <= {bar:g}"
                     f"{' on <= 2 cores' if two_cores else ''}): {_met(x <= bar)}; "
                     f"{'engine' if x < 1 else 'NIXL shm'} wins by {max(x, 1 / x):.1f}x")
        else:
            bw = r["shm_GBps"] and r["eng_GBps"] / r["shm_GBps"]
            v.append(f"handoff {r['case']}: engine {r['eng_GBps']:.2f} GB/s vs NIXL shm "
                     f"{r['shm_GBps']:.2f} GB/s = {bw:.2f}x (target >= 1.5): "
                     f"{_met(bw >= 1.5)}; "
                     f"{'engine' if bw > 1 else 'NIXL shm'} wins by {max(bw, 1 / bw):.1f}x")
    for r in out.get("keys", {}).get("rows", []):
        if r["op"] == "lookup":
            v.append(f"lookup: {r['Mkeys_per_s']:.2f} M keys/s (target >= 1): "
                     f"{_met(r['Mkeys_per_s'] >= 1)}")
    return v
