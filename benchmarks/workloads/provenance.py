"""Where a recorded figure comes from: the commit and the torch release it was measured at, written into
every `benchmarks/results/*.json` beside the figures, so a page that shows them can say so."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The short hash of HEAD, with `+` when the tree has changes (the figures are then of a tree in between)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + ("+" if dirty else "")


def stamp() -> dict[str, str]:
    import torch

    return {"commit": commit(), "torch": torch.__version__.split("+")[0], "python": platform.python_version()}
