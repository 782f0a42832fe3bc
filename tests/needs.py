"""Optional packages a test needs: skipped without them on a developer's machine, a failure under CI.

CI (`CI=true`) installs every optional package of the environment it runs (transformers, torchvision, timm,
pytorch-lightning in the default one; torch_xla in the XLA one), so a missing one there is a broken set-up,
and skipping would turn it into a green run that tested less.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest

INSTALL = {
    "torch_xla": "the XLA environment: ./dev setup xla (torch 2.9.0 + torch_xla 2.9.0 in .venv-xla)",
    "transformers": "pip install -e '.[thirdparty]' (./dev setup)",
    "torchvision": "pip install -e '.[thirdparty]' (./dev setup)",
    "timm": "pip install -e '.[thirdparty]' (./dev setup)",
    "pytorch_lightning": "pip install -e '.[lightning]' (./dev setup)",
}


def fast() -> bool:
    """The everyday tier (`./dev test --fast`): property tests draw a quarter of their examples."""
    return os.environ.get("PARTIR_TESTS", "") == "fast"


def examples(n: int) -> int:
    """`n` hypothesis examples, or a quarter of them (at least 2) in the fast tier (CI draws all `n`)."""
    return max(2, n // 4) if fast() and not in_ci() else n


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(name: str) -> ModuleType:
    """The module `name`; without it, the test is skipped, or fails under CI."""
    if importlib.util.find_spec(name) is None:
        why = f"{name} is not installed in this environment ({INSTALL.get(name, 'pip install ' + name)})"
        if in_ci():
            pytest.fail(f"CI: {why}; CI installs it, so the set-up is broken", pytrace=False)
        pytest.skip(why, allow_module_level=True)
    return importlib.import_module(name)
