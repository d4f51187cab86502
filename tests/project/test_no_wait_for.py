"""No ``asyncio.wait_for`` in the package.

On Python 3.11 (the oldest this project supports) ``wait_for`` returns the inner result and
drops the caller's cancellation when the cancel lands in the loop turns between the inner
awaitable completing and the caller resuming (fixed in 3.12). A pre-claim task lost its
cancellation that way and hung an engine's close forever (the CI hang of session 44,
``tests/engine/test_preclaim_cancel.py``). ``async with asyncio.timeout(t)`` (3.11+) raises
TimeoutError only for its own expiry and lets an outside cancellation through."""
from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "tract_async"


def _wait_for_calls(tree: ast.AST) -> list[int]:
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "wait_for" and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "asyncio"]


def test_the_check_finds_a_wait_for() -> None:
    assert _wait_for_calls(ast.parse("import asyncio\nasync def f(x):\n"
                                     "    await asyncio.wait_for(x, 1)\n")) == [3]


def test_the_package_calls_no_asyncio_wait_for() -> None:
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 50, files          # the package really was read
    found = [f"{p.relative_to(PKG.parent)}:{line}" for p in files
             for line in _wait_for_calls(ast.parse(p.read_text()))]
    assert not found, f"asyncio.wait_for drops cancellations on 3.11: {found}"
