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


class Transposed(nn.Module):
    """Dropout and `rand_like` noise on an activation that is not row-major (a linear over the transposed
    batch, transposed back: the layout `nn.TransformerEncoderLayer`'s dropout after attention reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x.transpose(0, 1)).transpose(0, 1)
        assert not h.is_contiguous()
        return self.drop(h) * torch.rand_like(h)


def _sgd_state(model: nn.Module) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, {n: {"momentum_buffer": torch.zeros_like(p)} for n, p in params.items()}


def test_draws_on_a_tensor_that_is_not_row_major_are_eager_s_in_every_engine():
    """Eager fills each random tensor in its operand's memory order; the captured step draws the same numbers
    (`draws.dropout`), and so does every device of the simulator (`draws.in_memory_order`)."""
    from partir_torch.ir import Mesh, Tile
    from partir_torch.propagate import ShardingState
    from partir_torch.simulate import simulate

    torch.manual_seed(0)
    model, x = Transposed().train(), torch.randn(4, 6, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    program = capture(model, (x,), _loss, opt)
    assert sum(op.target == "aten.permute.default" for op in program.ops) >= 4  # both draws in memory order
    params, states = _sgd_state(model)
    torch.manual_seed(1)
    out = program.run(params, {}, (x,), states)
    torch.manual_seed(1)
    assert out[program.loss].item() == _loss(model, x).item()

    state = ShardingState(program, Mesh.parse("batch=2,x=2"))
    state.apply(Tile(program.values[program.inputs[0]].name, 0, "batch"))
    state.apply(Tile("lin.weight", 0, "x"))
    torch.manual_seed(1)
    res = simulate(program, state, params, {}, (x,), states)
    assert res.max_abs_diff <= 1e-6, res.diffs


def test_the_layer_drop_draw_still_takes_from_the_generator_as_eager_does():
    """The draw a block is skipped on is a constant to the trace, but still drawn: the per-element mask after
    it is the one eager draws (HF OPT's dropout masks after its LayerDrop draws)."""
    torch.manual_seed(0)
    model, x = Stack(skip=0.0).train(), torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    program = capture(model, (x,), _loss, opt)
    params, states = _sgd_state(model)
    torch.manual_seed(1)
    out = program.run(params, {}, (x,), states)
    torch.manual_seed(1)
    assert out[program.loss].item() == _loss(model, x).item()
