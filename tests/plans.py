"""Random plans for the tests that prove every plan, not only the experts' (the simulator, the layout walk)."""

from __future__ import annotations

import random

from partir_torch.ir import Role, Tile
from partir_torch.propagate import ShardingState


def random_plan(program, mesh, seed, n: int = 8) -> ShardingState:
    """`n` random tiles of parameters, inputs and optimizer states (illegal ones skipped), from `seed`."""
    rng = random.Random(seed)
    state = ShardingState(program, mesh)
    pool = [v for v in program.values if v.role in (Role.PARAMETER, Role.INPUT, Role.OPT_STATE) and v.shape]
    for _ in range(n):
        v = rng.choice(pool)
        state.try_apply(Tile(v.name, rng.randrange(len(v.shape)), rng.choice(mesh.names)))
    return state
