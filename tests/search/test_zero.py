"""The search's ZeRO move (`search/zero.py`): what a stage-3 move gathers and what it keeps tiled."""

from __future__ import annotations

import torch

from partir_torch import capture
from partir_torch.ir import Mesh, Tile
from partir_torch.propagate import ShardingState
from partir_torch.search.space import apply_action
from partir_torch.search.zero import ShardOptimizer
from partir_torch.simulate import simulate


class _Stack(torch.nn.Module):
    """Not a zoo model: three linears, only the middle one with a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16, bias=False)
        self.b = torch.nn.Linear(16, 32)
        self.c = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_stage3_keeps_a_weight_transpose_tiled_where_its_bias_already_tiles_the_linear():
    """zero3(*) tiles every weight and bias on `model`. The middle linear's bias, tiled on its output dim, makes
    its addmm column-parallel; gathering its weight's transpose would only hand the addmm a tile it slices
    again and keep the whole weight for the backward. So that transpose stays tiled, and the backward runs
    on it: the partial input gradient is all-reduced over `model` instead of the weight gathered. The
    linears without a bias still have their transposed weight gathered, as stage 3 does."""
    from partir_torch.ir.program import Phase
    from partir_torch.lower import lower, relayouts

    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(8, 16)
    p = capture(model, (x,), lambda m, t: m(t).square().mean(), "adamw")
    state = ShardingState(p, Mesh.parse("batch=2,model=4"))
    state.apply(Tile("inputs[0]", 0, "batch"))
    assert apply_action(state, ShardOptimizer("*", -1, "model", 3))
    relay = relayouts(p, state.rules)

    def root(v: int) -> str:
        while relay[v] >= 0:
            v = state.rules[relay[v]].operands[0].value
        return p.values[v].name

    transposes = {v.id: root(v.id) for v in p.values if relay[v.id] >= 0 and v.role.value != "gradient"}
    assert {n for v, n in transposes.items() if "model" in state.shard[v].axes} == {"b.weight"}
    gathered = {root(c.value) for c in lower(state) if c.kind == "all-gather" and c.axis == "model"}
    assert {"a.weight", "c.weight"} <= gathered and "b.weight" not in gathered, gathered
    partial_grads = [c for c in lower(state) if c.kind == "all-reduce" and c.axis == "model"
                     and p.ops[p.values[c.value].producer].phase is Phase.BACKWARD
                     and p.ops[p.values[c.value].producer].module == "b"]
    assert partial_grads, "the input gradient of b is not summed over model"
    params = {n: t.detach() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    states = {n: {"exp_avg": torch.randn(t.shape, generator=g) * 0.01, "exp_avg_sq": torch.rand(t.shape, generator=g)
                  * 0.01, "step": torch.tensor(3.0)} for n, t in model.named_parameters()}
    res = simulate(p, state, params, {}, (x,), states)
    assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5
