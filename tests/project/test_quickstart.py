"""examples/quickstart.py runs as written, twice in a row, and the README shows it verbatim."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def test_quickstart_runs_twice_and_cleans_up(region_path: str) -> None:
    """Twice at one path: the region it creates must not outlive it (remove_on_close), or the
    second run fails with RegionExists, as the old README snippet's did."""
    # the tree under test, as every other test process imports it (pytest's pythonpath, the
    # spawned workers): run as a script, the example would import the installed copy, which with
    # a non-editable install (.ci/run's) is other source files, cold in Numba's cache, and its
    # Engine.open ran the whole warm-up scenario again (139 s of a loaded clean-clone CI)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    for _ in range(2):
        res = subprocess.run([sys.executable, str(QUICKSTART), region_path], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "prefix hit 6/10 blocks" in res.stdout and "bit-exact" in res.stdout, res.stdout
        assert not os.path.exists(region_path)


def test_readme_shows_the_quickstart_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{QUICKSTART.read_text()}```\n" in readme, \
        "README.md's quickstart block differs from examples/quickstart.py: paste the file"
