"""pyproject lists every subpackage (setuptools' explicit list): a package left out installs
without it, which an editable install and the repo's own tests would never notice."""
from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {"tract_kernels"} | {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "tract_async").rglob("__init__.py")}
    assert found == listed, f"missing: {sorted(found - listed)}, stale: {sorted(listed - found)}"
