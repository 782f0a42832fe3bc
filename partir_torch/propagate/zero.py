"""What the ZeRO action (`ir.actions.ShardOptimizer`) does to a state: fence, then tile.

For one parameter group (or, with target `*`, for every parameter with optimizer state, each on its first
dim that divides: the expert's move, which a model with dozens of distinct layers could not reach one group
at a time): the forward and backward ops that read the parameter or write its gradient are fenced on the axis
(their other tensors kept as they are), so the optimizer's sharding does not leak into the model; then the
group's per-parameter optimizer states are tiled on `dim` (stage 1), its gradients too (stage 2: reduce-
scattered, not all-reduced), and its parameters (stage 3: gathered where they are used, as FSDP does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partir_torch.errors import IllegalActionError
from partir_torch.ir.actions import ShardOptimizer, Tile
from partir_torch.ir.program import Phase
from partir_torch.ir.sharding import divides

if TYPE_CHECKING:
    from partir_torch.propagate.state import ShardingState


def apply_zero(state: ShardingState, action: ShardOptimizer) -> None:
    """Fence, then tile; the caller records the action as one decision (its tiles follow from it)."""
    if action.stage not in (1, 2, 3):
        raise IllegalActionError(f"ZeRO stage must be 1, 2 or 3, got {action.stage}")
    p = state.program
    if action.target == "*":  # every parameter with optimizer state, each on its first dim that divides
        chosen = zero_all(state, action.axis, action.stage)
        if not chosen:
            raise IllegalActionError(f"no optimizer state left to shard on {action.axis!r}")
        _fence(state, action, [n for n, _ in chosen])  # all fences first: no tile may leak past a later fence
        for name, d in chosen:
            _tiles(state, action, [name], d)
        return
    members = [p.values[v].name for v in state.resolve(action.target)]
    for name in members:
        if name not in p.opt_states:
            raise IllegalActionError(f"{name} has no optimizer state to shard")
    _fence(state, action, members)
    _tiles(state, action, members, action.dim)


def _fence(state: ShardingState, action: ShardOptimizer, members: list[str]) -> None:
    p = state.program
    fence: set[int] = set()
    params, grads = set(), set()
    for name in members:
        pv, gv = p.params[name], p.grads.get(name)
        params.add(pv)
        if gv is not None:
            grads.add(gv)
        for v in (pv, gv):
            if v is None:
                continue
            for o in state.ops_of[v]:
                if p.ops[o].phase is Phase.OPTIMIZER:
                    continue
                for t in (*state.rules[o].operands, *state.rules[o].results):
                    fence.add(t.value)
    fence -= params | grads
    if action.stage < 3:
        fence |= params  # the parameter stays whole on the axis (stage 3: gathered where it is used)
    if action.stage < 2:
        fence |= grads  # the gradient too (stage 2 and 3: tiled, so reduce-scattered)
    state.lock(fence, action.axis)
    if action.stage == 3:
        state.gather_at_use([p.params[n] for n in members], action.axis)


def _tiles(state: ShardingState, action: ShardOptimizer, members: list[str], dim: int) -> None:
    p = state.program
    for name in members:
        states = [v for s, v in p.opt_states[name].items() if s not in p.shared_states]
        targets = ([p.params[name]] if action.stage == 3 else []) + states
        if action.stage == 2 and name in p.grads:
            targets.append(p.grads[name])
        for v in targets:
            if action.axis in state.shard[v].axes:
                continue
            state.apply(Tile(p.values[v].name, dim, action.axis))


def zero_all(state: ShardingState, axis: str, stage: int, first: bool = False) -> list[tuple[str, int]]:
    """What `ShardOptimizer("*", -1, axis, stage)` tiles: (parameter, its first dim that divides); `first`:
    stop at the first one (is the move legal?)."""
    p = state.program
    chosen = []
    for name, st in p.opt_states.items():
        per = [v for s, v in st.items() if s not in p.shared_states]
        pv = p.params[name]
        for d in range(len(p.values[pv].shape)):
            if per and fits(state, per[0], d, axis) and (stage < 3 or fits(state, pv, d, axis)):
                chosen.append((name, d))
                if first:
                    return chosen
                break
    return chosen


def fits(state: ShardingState, v: int, dim: int, axis: str) -> bool:
    """Whether `v` can still be tiled on `axis` along `dim` (not on the axis yet, not fenced, divisible)."""
    val, sh = state.program.values[v], state.shard[v]
    if axis in sh.axes or axis in state.locked[v]:
        return False
    return divides(val.shape[dim], state.mesh, (*sh.dims[dim], axis))


def hold_split(state: ShardingState, axis: str, dims: dict[str, int]) -> None:
    """Parameters stored tiled on `axis` (`dims`: parameter -> dim) and gathered where they are read, as stage 3
    holds them, in a program without optimizer states (the forward of a plan with a ZeRO-3 move)."""
    _fence(state, ShardOptimizer("*", -1, axis, 3), list(dims))
    for name, d in dims.items():
        state.apply(Tile(name, d, axis))
