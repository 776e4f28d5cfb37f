"""Every relative link in README.md and docs/ points at a file of the repository, and every ``#anchor`` at a
heading of its target (GitHub's heading ids), so a renamed file or heading breaks a test, not a reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def heading_ids(text: str) -> set[str]:
    """GitHub's ids of the Markdown headings: lower case, punctuation dropped, spaces as hyphens, ``-1``,
    ``-2`` ... on repeats."""
    ids: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        base, n = slug, 0
        while slug in ids:
            n += 1
            slug = f"{base}-{n}"
        ids.add(slug)
    return ids


def links(page: Path) -> list[str]:
    """The link targets of a page outside code blocks and inline code, without external ones."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_heading_ids_follow_github():
    text = "# A `code` title: with, punctuation\n## Same\n## Same\n```\n# not a heading\n```\n"
    assert heading_ids(text) == {"a-code-title-with-punctuation", "same", "same-1"}


def test_the_readme_stays_short():
    """The README is the front page: status, quick start, headline results, pointers; detail lives in docs/."""
    assert len((ROOT / "README.md").read_text()) <= 12_000
