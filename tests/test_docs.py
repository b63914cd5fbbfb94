"""The prose: README stays an overview (at most 250 lines, its test command kept) and every
relative link in README.md, CHANGELOG.md and docs/ reaches a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_an_overview():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text
    for page in sorted((ROOT / "docs").glob("*.md")):
        linked = f"(docs/{page.name}" in text or any(f"({page.name}" in q.read_text()
                                                      for q in PAGES)
        assert linked, f"nothing links docs/{page.name}"


def _prose(text: str) -> str:
    """``text`` without code blocks and inline code (``f(x)`` is not a link)."""
    return re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _prose(page.read_text())):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_docs_name_the_pinned_transformers():
    """Every "transformers X.Y" the prose names is the version setup.py pins."""
    pin = re.search(r'"transformers==([\d.]+)"', (ROOT / "setup.py").read_text())[1]
    pages = [p for p in PAGES if p.name != "CHANGELOG.md"]
    version = re.compile(r"transformers (\d+\.\d+(?:\.\d+)?)\b")
    named = {(p.name, v) for p in pages for v in version.findall(p.read_text())}
    assert named and all(v == pin for _, v in named), (pin, named)
