"""The search's ZeRO move: a parameter group's optimizer states (stage 1) and parameters (stage 3) sharded.

`ShardOptimizer(target, dim, axis, stage)` is the ZeRO move for one parameter group (or, with target `*`,
for every parameter at once, each on its first dim that divides: the expert's move, which a model with
dozens of distinct layers could not reach one group at a time): the group's per-
parameter optimizer states (stage 1), and its parameters (stage 3) are tiled on `dim`, while the forward and
backward ops that read the parameter or write its gradient are fenced on the axis (their other tensors kept
as they are), so the optimizer's sharding does not leak into the model: a stage-3 parameter is gathered
where it is used and its gradient reduce-scattered, exactly as `tactics.ZeRO` does for all parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from partir_torch.errors import IllegalActionError
from partir_torch.ir.actions import Tile
from partir_torch.ir.program import Phase
from partir_torch.ir.sharding import divides
from partir_torch.propagate import ShardingState


@dataclass(frozen=True, order=True)
class ShardOptimizer:
    """ZeRO for one parameter (group): optimizer states (stage 1) and the parameter (stage 3) on `dim`."""

    target: str  # a parameter name or group key
    dim: int
    axis: str
    stage: int = 1

    def __str__(self) -> str:
        return f"zero{self.stage}({self.target}, {self.dim}, {self.axis!r})"

    def apply(self, state: ShardingState) -> None:
        """Fence, then tile; the state records this move as one decision (its tiles follow from it)."""
        made = len(state.actions)
        self._apply(state)
        state.actions[made:] = [self]

    def _apply(self, state: ShardingState) -> None:
        p = state.program
        if self.target == "*":  # every parameter with optimizer state, each on its first dim that divides
            chosen = zero_all(state, self.axis, self.stage)
            if not chosen:
                raise IllegalActionError(f"no optimizer state left to shard on {self.axis!r}")
            self._fence(state, [n for n, _ in chosen])  # all fences first: no tile may leak past a later fence
            for name, d in chosen:
                self._tiles(state, [name], d)
            return
        members = [p.values[v].name for v in state.resolve(self.target)]
        for name in members:
            if name not in p.opt_states:
                raise IllegalActionError(f"{name} has no optimizer state to shard")
        self._fence(state, members)
        self._tiles(state, members, self.dim)

    def _fence(self, state: ShardingState, members: list[str]) -> None:
        p = state.program
        fence: set[int] = set()
        own: set[int] = set()
        for name in members:
            pv, gv = p.params[name], p.grads.get(name)
            own.update(v for v in (pv, gv) if v is not None)
            for v in (pv, gv):
                if v is None:
                    continue
                for o in state.touch[v]:
                    if p.ops[o].phase is Phase.OPTIMIZER:
                        continue
                    for t in (*state.rules[o].operands, *state.rules[o].results):
                        fence.add(t.value)
        fence -= own
        if self.stage < 3:
            fence |= own
        state.lock(fence, self.axis)
        if self.stage == 3:
            state.gather_at_use([p.params[n] for n in members], self.axis)

    def _tiles(self, state: ShardingState, members: list[str], dim: int) -> None:
        p = state.program
        for name in members:
            states = [v for s, v in p.opt_states[name].items() if s not in p.shared_states]
            targets = ([p.params[name]] if self.stage == 3 else []) + states
            for v in targets:
                if self.axis in state.shard[v].axes:
                    continue
                state.apply(Tile(p.values[v].name, dim, self.axis))


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
    val, sh = state.program.values[v], state.shard[v]
    if axis in sh.axes or axis in state.locked[v]:
        return False
    return divides(val.shape[dim], state.mesh, (*sh.dims[dim], axis))
