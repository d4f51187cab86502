"""No module of the package reads another module's private names (issue 37's typed seams).

A name with one leading underscore is its module's business: another module that reads
``obj._name`` or imports ``_name`` depends on what its owner may change without notice (the
CUDA half once reached into the Engine's fields 26 times). The rule checked here: a private
attribute read on anything but ``self``/``cls`` is allowed only where the same file defines
that name (a class and its helpers in one module), or where the owner is a third party whose
interface it is (listed below, each with its reason).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "tract_async"

# the standard library's and third parties' own underscore APIs, by attribute
THIRD_PARTY_ATTRS = {
    "_fields": "namedtuple's public API",
    "_make": "namedtuple's public API",
    "_replace": "namedtuple's public API",
    "_asdict": "namedtuple's public API",
    "_C": "torch._C: the CUDA runtime bindings torch exposes no other way (cuda/events.py)",
    "_attn_implementation": "transformers' attention switch on a config (serving/model.py)",
    "_exit": "os._exit: how a forked child ends without its parent's cleanups (serving/zygote.py)",
}
# per file: Numba's cache internals, which the kernel-cache preload reads (no public API);
# ctypes.CDLL's library path
THIRD_PARTY_IN = {
    "tract_async/kernel_cache.py": {"_cache", "_cache_file", "_load_index", "_cache_path",
                                    "_index_key"},
    "tract_async/cuda/events.py": {"_name"},
}
THIRD_PARTY_MODULES = ("nixl",)   # nixl._api: NIXL's Python binding module


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute):
                        out.add(e.attr)
                    elif isinstance(e, ast.Name):
                        out.add(e.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and _private(n.value):
            out.add(n.value)           # __slots__ entries, namedtuple field names
    return out


def _violations(path: pathlib.Path) -> list[str]:
    rel = str(path.relative_to(ROOT)) if ROOT in path.parents else path.name
    tree = ast.parse(path.read_text())
    own = _defined(tree)
    allowed = set(THIRD_PARTY_ATTRS) | THIRD_PARTY_IN.get(rel, set())
    bad: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr):
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue                # a subclass extending its base's hook
            if n.attr in own or n.attr in allowed:
                continue
            bad.append(f"{rel}:{n.lineno}: reads {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and n.module:
            if n.module.split(".")[0] in THIRD_PARTY_MODULES:
                continue
            for a in n.names:
                if _private(a.name):
                    bad.append(f"{rel}:{n.lineno}: imports {a.name} from {n.module}")
    return bad


def test_no_module_reads_another_modules_private_names() -> None:
    bad = [v for p in sorted(PKG.rglob("*.py")) for v in _violations(p)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_cross_module_read(tmp_path: pathlib.Path) -> None:
    """A negative control: the rule flags what it is meant to flag."""
    f = tmp_path / "probe.py"
    f.write_text("from .engine import _Parts\n\ndef g(eng):\n    return eng._store\n")
    got = _violations(f)
    assert any("imports _Parts" in v for v in got) and any("reads eng._store" in v for v in got), got
