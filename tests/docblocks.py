"""The code blocks of a Markdown document, for the tests that run every block of the README and the guide."""

from __future__ import annotations

import re
import shlex
from pathlib import Path


def blocks(doc: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", doc.read_text(), flags=re.S | re.M)


def commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", block)
    lines = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [" ".join(shlex.quote(w) for w in words) for words in lines if words]
