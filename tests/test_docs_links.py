"""Every link and quoted repository path in the README and docs/ points to a file or folder that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "docs" / "results").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
QUOTED = re.compile(r"`((?:docs|profiling|flexentropy|bench|tests|reference|results)/[^`\s*{}<>$#]*)(?:#[^`\s]*)?`")


def targets(page: Path) -> list[tuple[str, list[Path]]]:
    """``(as written, candidate paths)`` of every local link and quoted path of ``page``."""
    text = page.read_text(encoding="utf-8")
    found = [(m, [page.parent / m]) for m in LINK.findall(text) if not re.match(r"[a-z]+:", m)]
    for quoted in QUOTED.findall(text):
        path = quoted.rstrip(".,:;")
        found.append((path, [ROOT / path, page.parent / path, ROOT / "docs" / path]))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    broken = sorted({written for written, candidates in targets(page)
                     if not any(c.exists() or Path(str(c).rstrip("/")).exists() for c in candidates)})
    assert not broken, f"{page.relative_to(ROOT)} points to missing paths: {broken}"
