"""Ranks for the torch backend's tests: started once per test module (`Workers`) and reused by its tests."""

from __future__ import annotations

import pytest

from partir_torch.launch import Workers


@pytest.fixture(scope="module")
def two():
    with Workers(2, timeout=600) as w:
        yield w


@pytest.fixture(scope="module")
def four():
    with Workers(4, timeout=600) as w:
        yield w
