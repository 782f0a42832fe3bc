"""The docs as a whole: every page reachable from the README, every picture shown, no dated work log."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_every_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_picture_appears_in_the_docs():
    text = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    shown = set(re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text))
    pictures = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.png")}
    assert pictures and pictures <= shown, f"pictures no page shows: {sorted(pictures - shown)}"


def test_no_page_is_a_dated_work_log():
    dated = [f"{p.name}:{i}" for p in [*DOCS.glob("*.md"), ROOT / "README.md"]
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b20\d\d-\d\d-\d\d\b|\bsession \d+\b", line, flags=re.I)]
    assert not dated, f"dated or per-session lines (the git log is the history): {dated[:10]}"
