"""The rule validation harness: random shardings of a small program, executed per device, vs unsharded.

`check(module, inputs, data)` captures `module`'s training step (SGD with momentum, so the optimizer
ops are in too), draws random legal tile actions for its parameters, inputs and a few intermediates on a
random mesh, propagates, simulates, and asserts the loss, gradients and updated parameters equal the
unsharded ones. At least one drawn tile must apply (else the run would compare unsharded with unsharded and
pass vacuously). Every rule family's tests call it with hypothesis; `run_plan` is the same with the actions
given (the mutation test uses it).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from partir_torch.capture import capture
from partir_torch.ir import Mesh, Role, Tile
from partir_torch.propagate import ShardingState
from partir_torch.rules.decompose import prepare
from partir_torch.simulate import SimResult, simulate

MESHES = [Mesh.parse("x=2"), Mesh.parse("x=4"), Mesh.parse("x=2,y=2"), Mesh.parse("x=2,y=4")]
_MAX_DRAWS = 24  # draws allowed beyond n_actions to find legal tiles


def _loss(model, *xs):
    out = model(*xs)
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)  # non-uniform upstream grad
    return (out * w).sum()


def _capture(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]):
    torch.manual_seed(0)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9) if list(module.parameters()) else None
    return prepare(capture(module, inputs, _loss, opt))


def _simulate(module, program, state, inputs) -> SimResult:
    params = {n: p.detach() for n, p in module.named_parameters()}
    states = {n: {"momentum_buffer": torch.randn_like(p) * 0.1} for n, p in module.named_parameters()}
    torch.manual_seed(1)  # random ops (dropout) draw from here, in the reference and the simulation alike
    return simulate(program, state, params, dict(module.named_buffers()), inputs, states)


def check(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], data, *, n_actions: int = 4,
          activations: bool = True, tol: float = 1e-5) -> ShardingState:
    program = _capture(module, inputs)
    mesh = data.draw(st.sampled_from(MESHES), label="mesh")
    state = ShardingState(program, mesh)
    roles = {Role.PARAMETER, Role.INPUT, Role.OPT_STATE} | ({Role.ACTIVATION} if activations else set())
    candidates = [v for v in program.values if (v.role in roles and v.shape and v.dtype.is_floating_point) or
                  (v.role is Role.INPUT and v.shape)]
    applied = 0
    for i in range(n_actions + _MAX_DRAWS):
        if i >= n_actions and applied:
            break
        v = data.draw(st.sampled_from(candidates), label="value")
        dim = data.draw(st.integers(0, len(v.shape) - 1), label="dim")
        axis = data.draw(st.sampled_from(mesh.names), label="axis")
        applied += state.try_apply(Tile(v.name, dim, axis))
    assert applied and any(sh.axes for sh in state.shard), "no drawn tile applied: the check would be vacuous"
    res = _simulate(module, program, state, inputs)
    # fp32 sums over tiles reassociate: compare relative to the reference's magnitude
    assert res.max_rel_diff <= tol, (
        res.diffs, [str(a) for a in state.actions], [c.describe(program) for c in state.conflicts]
    )
    assert res.replica_mismatch <= tol, ([str(a) for a in state.actions], res.replica_mismatch)
    return state


def run_plan(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], mesh: Mesh, actions: list[Tile]
             ) -> tuple[ShardingState, SimResult]:
    """Apply `actions` (each must apply) and simulate; the caller asserts on the result."""
    program = _capture(module, inputs)
    state = ShardingState(program, mesh)
    for a in actions:
        state.apply(a)
    return state, _simulate(module, program, state, inputs)
