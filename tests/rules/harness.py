"""The rule validation harness: random shardings of a small program, executed per device, vs unsharded.

`check(module, inputs, data)` captures `module`'s training step (SGD with momentum, so the optimizer
ops are in too), draws random legal tile actions for its parameters, inputs and a few intermediates on a
random mesh, propagates, simulates, and asserts the loss, gradients and updated parameters equal the
unsharded ones. Every rule family's tests call it with hypothesis.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from partir_torch import Role, capture
from partir_torch.ir import Mesh, Tile
from partir_torch.propagate import ShardingState
from partir_torch.simulate import simulate

MESHES = [Mesh.parse("x=2"), Mesh.parse("x=4"), Mesh.parse("x=2,y=2"), Mesh.parse("x=2,y=4")]


def _loss(model, *xs):
    out = model(*xs)
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)  # non-uniform upstream grad
    return (out * w).sum()


def check(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], data, *, n_actions: int = 4,
          activations: bool = True, tol: float = 1e-5) -> ShardingState:
    torch.manual_seed(0)
    program = capture(module, inputs, _loss, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
                      if list(module.parameters()) else None)
    mesh = data.draw(st.sampled_from(MESHES), label="mesh")
    state = ShardingState(program, mesh)
    roles = {Role.PARAMETER, Role.INPUT, Role.OPT_STATE} | ({Role.ACTIVATION} if activations else set())
    candidates = [v for v in program.values if (v.role in roles and v.shape and v.dtype.is_floating_point) or
                  (v.role is Role.INPUT and v.shape)]
    for _ in range(n_actions):
        v = data.draw(st.sampled_from(candidates), label="value")
        dim = data.draw(st.integers(0, len(v.shape) - 1), label="dim")
        axis = data.draw(st.sampled_from(mesh.names), label="axis")
        state.try_apply(Tile(v.name, dim, axis))
    params = {n: p.detach() for n, p in module.named_parameters()}
    states = {n: {"momentum_buffer": torch.randn_like(p) * 0.1} for n, p in module.named_parameters()}
    res = simulate(program, state, params, dict(module.named_buffers()), inputs, states)
    # fp32 sums over tiles reassociate: compare relative to the reference's magnitude
    assert res.max_rel_diff <= tol, (res.diffs, [str(a) for a in state.actions], [c.describe(program) for c in state.conflicts])
    assert res.replica_mismatch <= tol, ([str(a) for a in state.actions], res.replica_mismatch)
    return state
