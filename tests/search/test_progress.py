"""Search progress: a bar on a terminal, lines where stderr is piped (CI, logs)."""

from __future__ import annotations

import io
import re

import pytest

from partir_torch import models
from partir_torch.search import progress
from partir_torch.search.api import search


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_mode_follows_the_stream_unless_asked():
    assert progress.mode_of(None, io.StringIO()) == "lines" and progress.mode_of(True, _Tty()) == "bar"
    assert progress.mode_of(False, _Tty()) is None and progress.mode_of("lines", _Tty()) == "lines"
    with pytest.raises(ValueError, match="'auto', 'bar' or 'lines'"):
        progress.mode_of("verbose")


def test_a_piped_search_logs_the_budget_the_best_cost_and_the_rate(monkeypatch, capsys):
    monkeypatch.setattr(progress, "EVERY_S", 0.0)  # a line at every episode (5 s apart otherwise)
    net, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    search(net, inputs, "batch=2,model=2", loss_fn=loss_fn, budget=30, memory="300KiB", cache=False)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("partir_torch: MCTS on")]
    assert lines, "no progress line on a piped stderr"
    assert all("episodes (" in x and "/s); " in x for x in lines), lines[:3]
    assert all(re.search(r": \d+/\d+ episodes \(\d+/s\)", x) for x in lines), lines[:3]  # this phase's share
    assert any(" ms, fits" in x or " ms, does not fit" in x for x in lines), lines[:3]


def test_progress_false_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    net, inputs, loss_fn = models.build("tiny-mlp", device="meta")
    search(net, inputs, "batch=2,model=2", loss_fn=loss_fn, budget=10, cache=False, progress=False)
    assert "MCTS on" not in capsys.readouterr().err
