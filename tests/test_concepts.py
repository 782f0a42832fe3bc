"""`docs/concepts.md`'s worked examples hold (doctests)."""

from __future__ import annotations

import doctest
from pathlib import Path

CONCEPTS = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"


def test_every_worked_example_of_the_concepts_holds():
    res = doctest.testfile(str(CONCEPTS), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False)
    assert res.attempted >= 20 and res.failed == 0, res
