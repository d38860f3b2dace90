"""The README stays a first screen, and every relative link in it and in docs/ leads somewhere.

A page that moves or a heading that is renamed breaks links silently on a rendered site; this test names each one.
Anchors are checked against the headings of the target page, slugged the way GitHub renders them.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text a reader sees as links: code blocks and code spans hold examples, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, spaces, hyphens kept),
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c.isalnum() or c in " -_" or unicodedata.category(c).startswith("M"))
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_the_readme_fits_a_first_reading() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not Markdown")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_the_dashboard_picture_is_shown_somewhere() -> None:
    picture = (ROOT / "docs" / "dashboard.png").resolve()
    assert any((p.parent / t.partition("#")[0]).resolve() == picture for p in PAGES for t in relative_links(p))


def test_the_link_checker_sees_what_it_checks() -> None:
    """Guards the checker itself: a regex that matched nothing would pass every page."""
    assert slug("Secrets at rest (`FT_SECRETS_KEY`)") == "secrets-at-rest-ft_secrets_key"
    assert slug("Llama-3.2-1B at the hardware's edge: calls 13–15") == "llama-32-1b-at-the-hardwares-edge-calls-1315"
    assert relative_links(README), "no relative link found in README.md"
    sample = "[a](x.md#y) ![b](p.png) [c](https://e.com) `[d](code.md)`\n```\n[e](fenced.md)\n```\n"
    assert LINK.findall(prose(sample)) == ["x.md#y", "p.png", "https://e.com"]


def test_every_module_path_the_pages_name_exists() -> None:
    # A restructure moves files; a page that still names the old place sends a newcomer nowhere.
    named = {(p.name, m) for p in PAGES for m in re.findall(r"`([a-z_]+(?:/[a-z_]+)+\.py)`", p.read_text())}
    assert len(named) > 20, "the check found too few module paths to be looking at the pages"
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert missing == [], missing
