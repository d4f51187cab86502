"""The lower layers stay lower (STYLE.md: trio's ``_core``): the kernels and the region
substrate import no asyncio and nothing from the layers above them (sync, engine, stores,
transports, cuda, serving), so a protocol there can be read, tested and model-checked alone."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
UPPER = ("tract_async.sync", "tract_async.engine", "tract_async.transport", "tract_async.cuda",
         "tract_async.serving", "tract_async.stores", "tract_async.tools.fsck", "tract_async.cli",
         "tract_async.loadtest")


def _imports(path: pathlib.Path, package: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:            # relative: resolve against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


LOWER = sorted([(p, "tract_async.region") for p in (ROOT / "tract_async" / "region").glob("*.py")]
               + [(p, "tract_kernels") for p in (ROOT / "kernels").glob("*.py")],
               key=lambda t: str(t[0]))


@pytest.mark.parametrize("path,package", LOWER, ids=lambda v: getattr(v, "name", v))
def test_lower_layers_import_no_asyncio_and_nothing_above(path: pathlib.Path,
                                                          package: str) -> None:
    found = _imports(path, package)
    assert not {m for m in found if m == "asyncio" or m.startswith("asyncio.")}, \
        f"{path.name} imports asyncio"
    above = sorted(m for m in found if m.startswith(UPPER))
    assert not above, f"{path.name} imports the layers above it: {above}"
