"""A one-element random draw a model branches on is captured as its upper bound (`capture/draws.py`)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from partir_torch.capture import capture
from partir_torch.capture.draws import ScalarDraws


class Stack(nn.Module):
    """Blocks skipped at random in training mode, the way LayerDrop decides (a scalar draw against `skip`),
    and a per-element random mask that stays a random op."""

    def __init__(self, skip: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            coin = torch.rand([])
            if self.training and coin < self.skip:
                continue
            x = torch.relu(block(x))
        return x * (torch.rand(x.shape) < 0.9)


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).square().mean()


def test_a_layer_drop_draw_in_training_mode_captures_the_step_that_keeps_every_block():
    model, x = Stack(skip=0.0).train(), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a drop probability of 0 skips nothing: nothing to warn of
        program = capture(model, (x,), _loss, "sgd")
    mms = [op for op in program.ops if op.target in ("aten.addmm.default", "aten.mm.default")]
    assert len(mms) == 3 + 3 + 2  # every block's forward and weight-gradient matmuls, and the input gradients
    # of all but the first (its input is the batch)
    assert {op.module for op in mms if op.phase.name == "FORWARD"} == {f"blocks.{i}" for i in range(3)}
    assert any("rand" in op.target for op in program.ops)  # the per-element mask is drawn, not made a constant


def test_a_positive_drop_probability_is_named_with_the_line_that_draws():
    model, x = Stack(skip=0.25).train(), torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"test_draws\.py:\d+ is compared with 0.25 .*LayerDrop"):
        program = capture(model, (x,), _loss, "sgd")
    assert len([op for op in program.ops if op.target == "aten.addmm.default"]) == 3


def test_the_draw_keeps_its_shape_and_dtype_and_other_draws_stay_random():
    with ScalarDraws() as draws:
        one = torch.rand([], dtype=torch.float64)
        row = torch.rand(1)
        many = torch.rand(2, 3)
    assert one.dtype == torch.float64 and one.shape == () and float(one) == 1.0
    assert row.shape == (1,) and float(row) == 1.0
    assert many.shape == (2, 3) and bool((many < 1).all())  # (a real draw: below 1 everywhere)
    assert draws.skipping == []


class Clamped(nn.Module):
    """A training-only branch on a tensor's value that is not a draw: still the capture's error."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.training and y.abs().max() > 10:
            y = y.clamp(-10, 10)
        return y


def test_a_training_only_branch_on_values_says_to_capture_in_eval_mode():
    from partir_torch.errors import CaptureError

    with pytest.raises(CaptureError, match=r"test_draws\.py:\d+ .*only in training mode: capture the model in eval"):
        capture(Clamped().train(), (torch.randn(4, 8),), _loss, "sgd")
    capture(Clamped().eval(), (torch.randn(4, 8),), _loss, "sgd")
