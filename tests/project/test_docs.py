"""The documentation holds together (issue 37): README.md stays a short user's guide, every
relative link in README.md and docs/*.md leads to a file (and, for a link into a Markdown file,
to a heading), every result file they cite under ``bench/results/`` exists, and docs/design.md
defines every invariant that the code cites by number.

Reads files only: no import of the package."""
from __future__ import annotations

import glob
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
README_MAX_LINES = 300
# where the code and the docs cite the design by invariant number
CITING = ("tract_async", "kernels", "tests", "bench", "examples", "model")
CITING_FILES = ("SECURITY.md",)


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _text_without_code_spans(text: str) -> str:
    """The text with fenced code blocks blanked (links inside them are code, not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = heading.strip().lower().replace("`", "")
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = _text_without_code_spans(md.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


def _links(md: Path) -> list[str]:
    text = _text_without_code_spans(md.read_text())
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


def _expand_braces(pattern: str) -> list[str]:
    """``a-{x,y}-b`` -> ``a-x-b``, ``a-y-b`` (every brace group)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    out = []
    for combo in itertools.product(*choices):
        out.append("".join(f + c for f, c in zip(fixed, combo)) + fixed[-1])
    return out


def _cited_results(md: Path) -> list[str]:
    """``bench/results/...`` paths cited in a document, except those read out of git history
    (``git show <sha>:bench/results/...``: not in the tree on purpose)."""
    found = []
    path = r"bench/results/(?:[^\s`'\")\]|,;{]|\{[^}\s]*\})*"    # commas only inside {a,b}
    for m in re.finditer(rf"(git show [0-9a-f]{{7,40}}:)?({path})", md.read_text()):
        if m.group(1):
            continue
        found.append(m.group(2).rstrip(".:"))
    return found


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): move "
                                   f"detail into docs/ (measurement diaries: docs/history.md)")


@pytest.mark.parametrize("md", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md: Path) -> None:
    bad = []
    for target in _links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not bad, f"{md.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("md", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_result_files_exist(md: Path) -> None:
    missing = [p for p in _cited_results(md)
               if not all(glob.glob(str(ROOT / q)) for q in _expand_braces(p))]
    assert not missing, (f"{md.relative_to(ROOT)} cites result files that are not in the tree "
                         f"(cite `git show <sha>:<path>` for one that a later run replaced): "
                         f"{missing}")


def _cited_invariants() -> dict[int, list[str]]:
    """Invariant numbers cited as "docs/design.md invariant(s) N[, N and N]" or "inv. N"."""
    pat = re.compile(r"(?:docs/design\.md|DESIGN\.md)\s+(?:invariants?|inv\.)\s+"
                     r"(\d+(?:\s*(?:,|and)\s*\d+)*)", re.I)
    files = [ROOT / f for f in CITING_FILES]
    for d in CITING:
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh", ".pml")]
    cited: dict[int, list[str]] = {}
    for f in files:
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", f.read_text(errors="replace"))  # join lines
        for m in pat.finditer(text):
            for n in re.findall(r"\d+", m.group(1)):
                cited.setdefault(int(n), []).append(str(f.relative_to(ROOT)))
    return cited


def test_code_cites_the_design_file_that_exists() -> None:
    stale = []
    for d in CITING:
        for p in (ROOT / d).rglob("*.py"):
            if p != Path(__file__).resolve() and re.search(r"(?<!docs/)DESIGN\.md",
                                                           p.read_text(errors="replace")):
                stale.append(str(p.relative_to(ROOT)))
    assert DESIGN.exists()
    assert not stale, f"cite docs/design.md, not DESIGN.md (no such file): {stale}"


def test_design_defines_every_cited_invariant() -> None:
    cited = _cited_invariants()
    assert cited, "no invariant citations found: has the citation form changed?"
    defined = {int(n) for n in re.findall(r"^### Invariant (\d+):", DESIGN.read_text(), flags=re.M)}
    missing = {n: sorted(set(where)) for n, where in cited.items() if n not in defined}
    assert not missing, f"docs/design.md does not define invariants cited by the code: {missing}"
