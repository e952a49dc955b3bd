"""The documentation's relative links lead somewhere: every `[text](path)` and `[text](path#anchor)`
in README.md, DEPLOYMENT.md and docs/*.md names a file of this repository (and a heading of it),
and every page of docs/ is linked from the README, so none is left unreachable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "DEPLOYMENT.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\n]|\n(?!\n))*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def unfenced(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """`text` without code blocks and inline code (a `[x](y)` there is not a link)."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def anchor(heading: str) -> str:
    """GitHub's id of a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[*_`]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#+\s+(.+?)\s*#*$", unfenced(page.read_text()), re.M)}


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(page.read_text()))]


def broken(page: Path, root: Path = ROOT) -> list[str]:
    found = []
    for link in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if root not in target.parents:
            found.append(f"{link} (outside the repository)")
        elif not target.exists():
            found.append(f"{link} (no such file)")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            found.append(f"{link} (no heading #{fragment} in {target.name})")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == [], f"{page.relative_to(ROOT)}: broken links"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[2:] if p.resolve() not in linked]
    assert unlinked == [], f"docs/ pages the README does not link: {unlinked}"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    """(This test's own check: a wrong file, a wrong heading, one outside; none in code.)"""
    (tmp_path / "other.md").write_text("# The other page\n\n## Its `code` part\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[a](other.md) [b](other.md#the-other-page) [c](other.md#its-code-part)\n"
        "[d](missing.md) [e](other.md#nowhere) [f](../outside.md)\n"
        "`[g](missing-in-code.md)`\n```\n[h](missing-in-a-block.md)\n```\n"
        "[i](https://example.com/x.md)\n"
    )
    assert broken(page, tmp_path) == [
        "missing.md (no such file)",
        "other.md#nowhere (no heading #nowhere in other.md)",
        "../outside.md (outside the repository)",
    ]
