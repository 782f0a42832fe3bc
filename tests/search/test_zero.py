"""The ZeRO move (`ir.actions.ShardOptimizer`, `propagate/zero.py`) and `tactics.ZeRO` (that move on every
parameter): a stage-3 parameter is gathered where the forward reads it, whatever its reader's other tensors
are; the step stays exact (simulator)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partir_torch.capture import capture
from partir_torch.ir import Mesh, Tile
from partir_torch.ir.actions import ShardOptimizer
from partir_torch.ir.program import Phase
from partir_torch.lower import lower
from partir_torch.propagate import ShardingState
from partir_torch.simulate import simulate
from partir_torch.tactics import apply_schedule


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (m(x) - y).square().mean()


def _workload():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))  # (not a zoo model; biases)
    batch = (torch.randn(8, 16), torch.randn(8, 8))
    return model, batch, capture(model, batch, _loss, "adamw")


def _stage3(program, how: str) -> ShardingState:
    mesh = Mesh.parse("batch=2,model=4")
    if how == "tactic":
        return apply_schedule(program, mesh, "batch:BatchParallel;model:ZeRO(3)")
    state = ShardingState(program, mesh)
    state.apply(Tile("inputs[0]", 0, "batch"))
    state.apply(ShardOptimizer("*", -1, "model", 3))
    return state


@pytest.mark.parametrize("how", ["move", "tactic"])
def test_a_stage3_parameter_is_gathered_where_the_forward_reads_it(how):
    """A linear's bias tiled on its output dim would make the addmm column-parallel and its output gathered
    (the weight's transpose gathered, then sliced); ZeRO-3 instead gathers each parameter for its reader, and
    the forward gathers nothing but parameters."""
    model, batch, program = _workload()
    state = _stage3(program, how)
    params = set(program.params.values())
    assert all("model" in state.shard[v].axes for v in params)  # every parameter stored tiled
    forward = [c for c in lower(state) if c.op >= 0 and program.ops[c.op].phase is Phase.FORWARD
               and c.axis == "model"]
    assert {c.value for c in forward} == params and {c.kind for c in forward} == {"all-gather"}
    assert not any(state.factor_of(o, "model") is not None for o, op in enumerate(program.ops)
                   if op.phase is Phase.FORWARD)  # no forward op runs on a parameter's tile
    p = {n: t.detach() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    states = {n: {"exp_avg": torch.randn(t.shape, generator=g) * 0.01,
                  "exp_avg_sq": torch.rand(t.shape, generator=g) * 0.01, "step": torch.tensor(3.0)}
              for n, t in p.items()}
    res = simulate(program, state, p, {}, batch, states)
    assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5
