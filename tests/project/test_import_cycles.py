"""No module of the project (``tract_async`` and the kernels, ``tract_kernels``) is in an import
cycle (issues 16, 37).

A cycle that happens to import today (one side imports the other lazily inside a function, or
only under ``if TYPE_CHECKING:``) is still a two-way dependency: neither module can be read,
tested or replaced without the other, and a reordered import turns it into an ImportError at
start-up. So the graph is built from the source (``ast``), not from what one import run
happened to load, and it counts an import wherever it stands: at module level or in a function.

Two graphs:

* the *runtime* graph skips the bodies of ``if TYPE_CHECKING:`` (those never execute);
* the *typing* graph counts them too. The cycles of issue 16 lived there (``server`` and ``xfer``
  imported ``http.Agent``, ``nodes`` and ``rootdir`` imported ``region.Region``, for annotations
  only), and a type checker needs that graph acyclic as much as the interpreter needs the first.

Edges follow the convention of import linters (grimp): ``import a.b`` and ``from a import b``
(``b`` a module) are an edge to ``a.b``; ``from a.b import name`` (``name`` not a module) one to
``a.b``. The implicit import of a parent package (``a/__init__.py`` runs before ``a.b``) is not
an edge: every submodule would otherwise form a cycle with an ``__init__`` that re-exports it.
"""
from __future__ import annotations

import ast
import pathlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = {"tract_async": ROOT / "tract_async", "tract_kernels": ROOT / "kernels"}
"""Top-level package name -> its directory (the kernels install as ``tract_kernels``)."""

ACYCLIC = ("tract_async", "tract_kernels")
"""Every package: a cycle anywhere fails (the last one, ``engine`` <-> ``warmup``, went with the
split of ``kernel_cache`` out of ``warmup``)."""

Graph = dict[str, set[str]]


def find_modules(sources: Mapping[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every ``.py`` under each package directory."""
    out: dict[str, pathlib.Path] = {}
    for top, root in sources.items():
        for path in root.rglob("*.py"):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (nothing fancier is used, or supported)."""
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(nodes: Iterable[ast.AST], *, typing: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``nodes`` at any depth (functions, classes, try blocks), minus
    the bodies of ``if TYPE_CHECKING:`` unless ``typing`` (their ``else:`` runs, so it counts)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not typing and _is_type_checking(node.test):
            yield from _imports(node.orelse, typing=typing)
        else:
            yield from _imports(ast.iter_child_nodes(node), typing=typing)


def _owner(name: str, modules: Mapping[str, object]) -> str | None:
    """The longest prefix of ``name`` that is one of ours (``a.b.C`` -> ``a.b``), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: Mapping[str, pathlib.Path], *, typing: bool = False) -> Graph:
    """Module -> the modules of ours it imports (no self-edges)."""
    graph: Graph = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in _imports([ast.parse(path.read_text(), str(path))], typing=typing):
            if isinstance(node, ast.Import):
                targets.update(_owner(a.name, modules) for a in node.names)
                continue
            if node.level:   # relative: level 1 is this package, each further level one up
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                sub = f"{source}.{a.name}"
                targets.add(sub if sub in modules else _owner(source, modules))
        graph[mod] = {t for t in targets if t is not None and t != mod}
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """The components of more than one module (Tarjan, iterative), members sorted, in the
    order of their first member. Two modules import each other, directly or through others,
    exactly when they share one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


def a_cycle(graph: Graph, component: list[str]) -> list[str]:
    """One shortest cycle through the component's first member, as a path that ends where it
    starts (what a reader follows to find the import to remove)."""
    inside = set(component)
    start = component[0]
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & inside):
            if nxt == start:
                path = [node]
                while (up := parent[path[-1]]) is not None:
                    path.append(up)
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{component} is not strongly connected")  # pragma: no cover


def describe(graph: Graph, components: list[list[str]]) -> str:
    return "\n".join(f"  {' -> '.join(a_cycle(graph, c))}   (component: {', '.join(c)})"
                     for c in components)


def cycles_touching(graph: Graph, prefixes: tuple[str, ...]) -> list[list[str]]:
    """Components with a member in one of the packages ``prefixes``: a cycle that leaves a
    package and comes back is as much a two-way dependency as one inside it."""
    def inside(mod: str) -> bool:
        return any(mod == p or mod.startswith(p + ".") for p in prefixes)
    return [c for c in strongly_connected(graph) if any(inside(m) for m in c)]


MODULES = find_modules(SOURCES)


@pytest.mark.parametrize("typing", [False, True], ids=["runtime", "typing"])
@pytest.mark.parametrize("package", ACYCLIC)
def test_no_import_cycles(package: str, typing: bool) -> None:
    graph = import_graph(MODULES, typing=typing)
    found = cycles_touching(graph, (package,))
    if found:
        print(f"import cycles through {package} ({'with' if typing else 'without'} TYPE_CHECKING "
              f"imports):\n{describe(graph, found)}")
    assert not found, f"{package} is in an import cycle:\n{describe(graph, found)}"


def test_every_package_is_scanned() -> None:
    """A package missing from the scan would pass vacuously."""
    for package in ACYCLIC:
        assert sum(m.startswith(package + ".") for m in MODULES) >= 5, package
    assert "tract_kernels" in MODULES and "tract_kernels.intrinsics" in MODULES


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_negative_control(tmp_path: pathlib.Path) -> None:
    """The scan finds the shapes it is for, so a pass above means something: a cycle closed by
    an import inside a function (three modules, relative and absolute spellings), and one closed
    only under TYPE_CHECKING (found in the typing graph, not in the runtime graph); and it does
    not invent one from a parent package or from a name imported out of a module."""
    _write(tmp_path / "pkg", {
        "__init__.py": "from .a import A\n",
        "a.py": "from . import b\nA = 1\n",
        "b.py": "import pkg.c\n",
        "c.py": "def late():\n    from pkg.a import A\n    return A\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\n"
                "else:\n    import os\n",
        "e.py": "from .d import os\nE = 1\n",
        "sub/__init__.py": "",
        "sub/f.py": "from .. import a\nfrom ..sub import g\n",
        "sub/g.py": "from pkg.sub.f import something\n",
    })
    modules = find_modules({"pkg": tmp_path / "pkg"})
    runtime = import_graph(modules)
    assert runtime["pkg.sub.f"] == {"pkg.a", "pkg.sub.g"}
    assert runtime["pkg.e"] == {"pkg.d"} and runtime["pkg.d"] == set()
    assert strongly_connected(runtime) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.f", "pkg.sub.g"]]
    assert a_cycle(runtime, ["pkg.a", "pkg.b", "pkg.c"]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    typing = import_graph(modules, typing=True)
    assert ["pkg.d", "pkg.e"] in strongly_connected(typing)
    assert cycles_touching(typing, ("pkg.sub",)) == [["pkg.sub.f", "pkg.sub.g"]]
