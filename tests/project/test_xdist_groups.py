"""The test command's ``--dist loadgroup`` groups: every test of one ``xdist_group`` runs on
one worker (``tests/support/xdist_groups.py``; with pytest 9.2 and pytest-xdist 3.8 alone it
did not, and the racks of serving processes ran on several workers at once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
import json, os, time
import pytest

def _record(name):
    with open(os.path.join(os.environ["GROUPS_OUT"], name), "w") as f:
        json.dump(os.environ.get("PYTEST_XDIST_WORKER", "none"), f)

@pytest.mark.xdist_group("g")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    time.sleep(0.2)       # long enough that an ungrouped schedule spreads them
    _record(f"g{i}")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.2)
    _record(f"f{i}")
'''


def _workers(tmp_path: Path, dist: str) -> tuple[set[str], set[str]]:
    """The workers of the grouped and of the free tests of SUITE, run with ``--dist dist``."""
    suite, out = tmp_path / dist, tmp_path / f"out-{dist}"
    suite.mkdir()
    out.mkdir()
    (suite / "test_suite.py").write_text(SUITE)
    args = [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", dist,
            "-p", "no:cacheprovider", "--rootdir", str(suite), "-p", "tests.support.xdist_groups"]
    env = {**os.environ, "GROUPS_OUT": str(out), "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run(args + [str(suite)], cwd=suite, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert len(got) == 12, got
    return ({w for n, w in got.items() if n.startswith("g")},
            {w for n, w in got.items() if n.startswith("f")})


def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    grouped, free = _workers(tmp_path, "loadgroup")
    assert len(grouped) == 1, grouped
    assert len(free | grouped) > 1, (grouped, free)   # and the run did use several workers


def test_the_same_suite_without_grouping_spreads_the_group(tmp_path: Path) -> None:
    """The control: the suite's grouped tests do spread when nothing groups them (``--dist
    load``), so one worker above is the grouping's doing. (pytest 9.2 with pytest-xdist 3.8
    spread them under ``loadgroup`` too, without the plugin.)"""
    grouped, _ = _workers(tmp_path, "load")
    assert len(grouped) > 1, grouped
