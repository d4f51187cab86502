"""The soak for as long as you like (default an hour): random put, get, lookup and evict by real
processes under the incoherent backend, kill -9 and restart; prints operations, kills, wrong
bytes, fsck findings and memory growth, and writes JSON under bench/results/.

    python bench/soak.py --seconds 3600 [--workers 3] [--kill-every 6]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _common as C  # noqa: E402
from tract_async.tools import soak  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--kill-every", type=float, default=6.0, help="seconds between kills")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    path = f"/dev/shm/tract-soak-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    shown = [0.0]

    def progress(res: soak.SoakResult, latest: dict, now: float) -> None:
        if now - shown[0] >= 10:
            shown[0] = now
            gets = sum(c.get("gets", 0) for c in latest.values())
            print(f"  kills {res.kills}, restarts {res.restarts}, gets (live incarnations) "
                  f"{gets}", flush=True)
    t0 = time.time()
    try:
        res = soak.run(path, args.seconds, workers=args.workers, kill_every_s=args.kill_every,
                       seed=args.seed, progress=progress)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    row = {"seconds": round(time.time() - t0), "workers": args.workers, "kills": res.kills,
           "restarts": res.restarts, **{k: res.ops.get(k, 0) for k in
                                        ("puts", "layer_puts", "gets", "exact", "misses",
                                         "wrong", "evicts")},
           "fsck_findings": len(res.fsck_problems),
           "max_rss_growth_MiB": round(max(res.rss_growth_kib.values(), default=0) / 1024, 1)}
    print(C.table([row], list(row)))
    out = C.write_json("soak", {"machine": C.machine(), "args": vars(args), "result": row,
                                "errors": res.errors, "fsck": res.fsck_problems})
    print(f"wrote {out}")
    return 0 if not res.wrong and not res.fsck_problems and not res.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
