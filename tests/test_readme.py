"""The README is a front door: short, and every link in it leads somewhere.

The manual under docs/ is checked by `mkdocs build --strict` (make test); the README lies
outside the site, so its links (files, and anchors in Markdown pages) are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (mkdocs' default)."""
    return slugify(heading, "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+\s+(.+?)\s*$", text, re.M)}


def _links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_readme_links_resolve() -> None:
    broken = []
    for target in _links((ROOT / "README.md").read_text()):
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_link_check_sees_broken_links(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# A title: with `code` (x.py)\n\n## Two\n")
    assert _anchors(page) == {"a-title-with-code-xpy", "two"}
    assert _links("[a](p.md) [b](https://x.org) ![c](img.png#x)") == ["p.md", "img.png#x"]
