"""Shared fixtures: small real models to capture and to check captured programs against eager torch."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import settings

from tests import needs

# A failing draw of the property tests prints how to replay it (`@reproduce_failure`); under CI the draws are
# derandomized (the same cases on every run, so a red run is replayed by running it again).
settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", print_blob=True, derandomize=True)
settings.load_profile("ci" if needs.in_ci() else "dev")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    """Embedding, two repeated blocks, a head: enough to exercise roles, groups and attribution."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


@pytest.fixture(autouse=True)
def _plan_cache(tmp_path_factory, monkeypatch):
    """The plan cache is on by default: each test gets an empty one of its own (never the user's ~/.cache, and
    no test is served a plan another test searched)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model = TinyNet()
    tokens = torch.randint(0, 32, (2, 8))
    targets = torch.randint(0, 32, (2, 8))
    return model, (tokens, targets), lm_loss


def pytest_configure(config) -> None:
    """torch_xla's runtime starts before any test's backward: PyTorch sizes autograd's per-device queues at
    the first backward of a process, and a capture (a backward on fake tensors) before the runtime starts
    would make every later XLA backward in this test process fail (`backends.xla.runtime._probe_autograd`)."""
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        from partir_torch.backends.xla import start_runtime

        start_runtime(8)


def pytest_collection_modifyitems(config, items) -> None:
    """The unit tests listed in `tests/slow_ids.txt` (over 2.5 s in the fast tier) are `slow` too: out of
    `./dev test --fast`, run by CI like every test."""
    from pathlib import Path

    listed = {line.strip() for line in (Path(__file__).parent / "slow_ids.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item) -> None:
    """A test marked `xla` needs torch_xla (the XLA environment): skipped without it, or failed under CI
    (`CI=true`), where a missing package means a broken set-up, not a test to leave out."""
    if item.get_closest_marker("xla") is not None:
        needs.need("torch_xla")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """One line: which environment ran how many tests (`./dev test` runs two)."""
    import importlib.metadata
    import importlib.util

    stats = terminalreporter.stats
    counts = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
              for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    xla = "torch_xla " + importlib.metadata.version("torch_xla") if importlib.util.find_spec("torch_xla") else \
        "no torch_xla"
    ran = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    terminalreporter.write_line(f"environment: Python {sys.version.split()[0]}, torch {torch.__version__}, {xla}: "
                                f"{ran or 'no tests'}")
