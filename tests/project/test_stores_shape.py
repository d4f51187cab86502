"""The shape issue 37 asked of ``tract_async/stores/``: no module over 700 lines, and every
threshold that picks a put's or a read's path defined once, in ``stores/routing.py``."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
STORES = ROOT / "tract_async" / "stores"
MAX_LINES = 700


def test_no_stores_module_is_over_700_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in STORES.glob("*.py")}
    assert len(sizes) > 10, sizes                 # the folder really was read
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"stores modules over {MAX_LINES} lines: {over}"


def _thresholds() -> set[str]:
    tree = ast.parse((STORES / "routing.py").read_text())
    return {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name) and t.id.isupper()}


def test_path_thresholds_are_defined_only_in_routing() -> None:
    names = _thresholds()
    assert {"FUSED_MAX_BLOCKS", "INLINE_COPY_BYTES", "STAGE_BLOCKS", "PARALLEL_MIN_BLOCKS",
            "PARALLEL_INVALIDATE_BYTES"} <= names
    elsewhere = []
    for p in (ROOT / "tract_async").rglob("*.py"):
        if p == STORES / "routing.py":
            continue
        for n in ast.parse(p.read_text()).body:
            if not isinstance(n, ast.Assign):
                continue
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id in names:
                    # a re-export of routing's own value is not a second definition
                    v = n.value
                    if not (isinstance(v, ast.Attribute) and v.attr == t.id):
                        elsewhere.append(f"{p.relative_to(ROOT)}: {t.id}")
    assert not elsewhere, f"path thresholds defined outside stores/routing.py: {elsewhere}"
