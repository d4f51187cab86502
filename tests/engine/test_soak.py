"""The soak (``tract_async.soak``) for CI: random put, get, lookup and evict by real processes
under the incoherent backend, kill -9 and restart, then zero wrong bytes, zero fsck findings
and bounded memory. ``TRACT_SOAK_S`` sets the length (default 120 s; ``bench/soak.py`` runs
an hour)."""
from __future__ import annotations

import os

from tract_async import soak

SOAK_S = float(os.environ.get("TRACT_SOAK_S", "120"))
RSS_GROWTH_KIB = 96 << 10
"""Per worker, after its first report: caches fill once, then must not keep growing."""


def test_soak_zero_wrong_bytes_zero_findings_bounded_memory(region_path: str) -> None:
    res = soak.run(region_path, SOAK_S, workers=3, kill_every_s=max(4.0, SOAK_S / 20))
    print(f"soak {SOAK_S:.0f} s: kills {res.kills}, restarts {res.restarts}, ops {res.ops}, "
          f"rss growth KiB {res.rss_growth_kib}")
    assert not res.errors, res.errors
    assert res.wrong == 0, res.ops
    assert not res.fsck_problems, res.fsck_problems
    assert res.kills >= 3 and res.restarts >= 2, (res.kills, res.restarts)
    ops = res.ops
    assert ops["exact"] > 100 and ops["puts"] > 20 and ops["misses"] > 0, ops
    assert ops["evicts"] > 0 and ops["layer_puts"] > 0, ops
    assert max(res.rss_growth_kib.values()) < RSS_GROWTH_KIB, res.rss_growth_kib
