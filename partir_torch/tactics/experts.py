"""The manual tactics: the expert strategies, written as actions plus propagation.

A schedule is applied in order, each tactic to its fixpoint; later tactics never undo earlier decisions.
Text form: `"batch:BatchParallel;model:Megatron;batch:ZeRO(1)"` (`ZeRO3`, `FSDP`, `DP` also read).

- BatchParallel(axis): tile dim 0 of every program input.
- Megatron(axis): column/row pairs found from the program's structure: a linear (mm/addmm whose weight
  operand is a parameter, possibly transposed) whose output reaches another linear's input through ops that
  are not linears, normalizations or reductions. The first is tiled on its output features, the second on
  its input features. No module or parameter name is read.
- ZeRO(axis, stage): optimizer states (1), plus gradients (2), plus parameters (3) tiled on `axis` along
  their first divisible dim. Forward and backward values are fenced (kept as they are on `axis`), so the
  optimizer's sharding does not leak into the model's computation: sharded parameters are all-gathered
  where they are used, gradients reduce-scattered.
- FSDP(axis) = BatchParallel(axis) then ZeRO(axis, 3).
- Manual({glob: spec}): per-value specs in torch_xla's partition-spec form.

Every tactic, manual or searched (`search.api.Auto`), implements one protocol, `Tactic`:
`apply(state, context) -> state` returns the state the schedule continues from. The schedule text is read
through a registry (`register_tactic`): a tactic class registers its names and reads its own arguments, so
this module names no tactic of a later layer.
"""

from __future__ import annotations

import fnmatch
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from partir_torch.ir.actions import Tile
from partir_torch.ir.program import Phase, Program, Role
from partir_torch.ir.sharding import divides, tile_count
from partir_torch.propagate import ShardingState
from partir_torch.rules.tables import CASTS, LINEAR, PAIR_STOPS, TRANSPOSES
from partir_torch.tactics.schedule import Context, ScheduleError, register_tactic


@dataclass(frozen=True)
class _OnOneAxis:
    """A manual tactic: on one axis, no search."""

    axis: str
    searched: ClassVar[bool] = False

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,)

    @classmethod
    def from_text(cls, axes: tuple[str, ...] | None, args: list[str]):
        if axes is None or len(axes) != 1:
            raise ScheduleError(f"{cls.__name__} takes one axis, got {', '.join(axes or ('*',))}")
        if args:
            raise ScheduleError(f"{cls.__name__} takes no arguments, got {args}")
        return cls(axes[0])

    def text(self) -> str:
        return f"{self.axis}:{type(self).__name__}"


@register_tactic("BatchParallel", "DP")
@dataclass(frozen=True)
class BatchParallel(_OnOneAxis):
    def apply(self, state: ShardingState, context: Context | None = None) -> ShardingState:
        """Tile dim 0 of every input; why an input stayed replicated goes to `context.blocked`."""
        blocked = context.blocked if context is not None else []
        for v in state.program.inputs:
            val = state.program.values[v]
            if val.shape and not state.try_apply(Tile(val.name, 0, self.axis)) and self.axis not in state.shard[v].axes:
                blocked.append(_why(state, v, 0, self.axis))
        return state


def _uncast(program: Program, rules, v: int) -> int:
    """The value `v` is a dtype cast of (autocast casts the weight of each linear), else `v`."""
    while (prod := program.values[v].producer) >= 0 and program.ops[prod].target in CASTS \
            and program.values[v].shape == program.values[rules[prod].operands[0].value].shape:
        v = rules[prod].operands[0].value
    return v


def linears(program: Program, rules) -> dict[int, tuple[int, int, int]]:
    """Forward linears: op id -> (weight parameter, its output-features dim, its input-features dim)."""
    params = set(program.params.values())
    out = {}
    for op in program.ops:
        if op.phase is not Phase.FORWARD or op.target not in LINEAR:
            continue
        rhs = _uncast(program, rules, rules[op.id].operands[LINEAR[op.target][1]].value)
        if rhs in params and len(program.values[rhs].shape) == 2:
            out[op.id] = (rhs, 1, 0)  # x @ W with W [in, out]
            continue
        prod = program.values[rhs].producer
        if prod >= 0 and program.ops[prod].target in TRANSPOSES:
            w = _uncast(program, rules, rules[prod].operands[0].value)
            if w in params and len(program.values[w].shape) == 2:
                out[op.id] = (w, 0, 1)  # x @ W.T with W [out, in] (nn.Linear)
    return out


def megatron_pairs(program: Program, rules) -> list[tuple[int, int]]:
    """(column linear, row linear) op pairs, by forward data flow from each linear's output."""
    lin = linears(program, rules)
    lhs_of = {rules[o].operands[LINEAR[program.ops[o].target][0]].value: o for o in lin}
    params = set(program.params.values())
    pairs, rows = [], set()
    for o in lin:
        if o in rows:
            continue
        found, seen = [], set()
        todo = deque((v, 0) for v in program.ops[o].outputs if v >= 0)
        while todo:
            v, depth = todo.popleft()
            if v in seen or depth > 64:
                continue
            seen.add(v)
            for u in program.users[v]:
                uop = program.ops[u]
                if uop.phase is not Phase.FORWARD:
                    continue
                if u in lin:
                    if lhs_of.get(v) == u and u != o:
                        found.append(u)
                    continue
                if uop.target in PAIR_STOPS or any(i in params for i in uop.inputs):
                    continue
                todo.extend((r, depth + 1) for r in uop.outputs if r >= 0)
        for u in dict.fromkeys(found):
            pairs.append((o, u))
            rows.add(u)
    return pairs


@register_tactic("Megatron")
@dataclass(frozen=True)
class Megatron(_OnOneAxis):
    def apply(self, state: ShardingState, context: Context | None = None) -> ShardingState:
        """Tile each column/row pair of linears; why a weight stayed replicated goes to `context.blocked`."""
        blocked = context.blocked if context is not None else []
        p, lin = state.program, linears(state.program, state.rules)
        pairs = megatron_pairs(p, state.rules)
        if not pairs:
            blocked.append(f"no column/row pair of linears was found ({len(lin)} forward linears; a pair is a linear "
                           "whose "
                    "output feeds another's input without a normalization or reduction between them)")
            return state
        for col, row in pairs:
            w1, out1, _ = lin[col]
            w2, _, in2 = lin[row]
            for w, d in ((w1, out1), (w2, in2)):
                if not state.try_apply(Tile(p.values[w].name, d, self.axis)) and self.axis not in state.shard[w].axes:
                    blocked.append(_why(state, w, d, self.axis))
        return state


def _why(state: ShardingState, v: int, d: int, axis: str) -> str:
    """Why `v` could not be tiled on `axis` along `d`, and what would help."""
    val, n = state.program.values[v], state.program.values[v].shape[d]
    k = tile_count(state.mesh, (*state.shard[v].dims[d], axis))
    if not divides(n, state.mesh, (*state.shard[v].dims[d], axis)):
        return (f"{val.name} dim {d} has size {n}, not divisible by {k} (axis {axis!r}); use a size divisible by "
                f"{k} (e.g. {n + (-n) % k}) or a smaller axis")
    if axis in state.locked[v]:
        return f"{val.name} is replicated on {axis!r} by an earlier tactic"
    return f"{val.name} dim {d} conflicts with an earlier decision on {axis!r} (sharding {state.shard[v]})"


def _free_dim(state: ShardingState, v: int, axis: str) -> int | None:
    val, sh = state.program.values[v], state.shard[v]
    if axis in sh.axes:
        return None
    for d, size in enumerate(val.shape):
        if divides(size, state.mesh, (*sh.dims[d], axis)):
            return d
    return None


@register_tactic("ZeRO")
@dataclass(frozen=True)
class ZeRO(_OnOneAxis):
    stage: int = 1

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ScheduleError(f"ZeRO stage must be 1, 2 or 3, got {self.stage}")

    @classmethod
    def from_text(cls, axes: tuple[str, ...] | None, args: list[str]):
        """`ZeRO`, `ZeRO(2)`, `ZeRO(stage=2)` (the digit suffix, `ZeRO3`, arrives as an argument)."""
        stage = [a.removeprefix("stage").strip().lstrip("=").strip() for a in args]
        if len(stage) > 1 or (stage and not stage[0].isdigit()):
            raise ScheduleError(f"ZeRO takes one stage (1, 2 or 3), got {args}")
        tactic = super().from_text(axes, [])
        return cls(tactic.axis, int(stage[0])) if stage else tactic

    def text(self) -> str:
        return f"{self.axis}:ZeRO({self.stage})"

    def apply(self, state: ShardingState, context: Context | None = None) -> ShardingState:
        """Fence the forward and backward passes on `axis` (ZeRO changes only what the optimizer holds and
        reads; a sharded parameter is all-gathered where it is used), then tile states, grads, params."""
        p = state.program
        grads = set(p.grads.values())
        fenced = [v for op in p.ops if op.phase is not Phase.OPTIMIZER for v in op.outputs
                  if v >= 0 and not (self.stage >= 2 and v in grads)]
        state.lock(fenced, self.axis)
        if self.stage < 3:
            state.lock(p.params.values(), self.axis)
        else:
            state.gather_at_use(p.params.values(), self.axis)
        for name, states in p.opt_states.items():
            per_param = [v for s, v in states.items() if s not in p.shared_states]
            if not per_param:
                continue
            d = _free_dim(state, per_param[0], self.axis)
            if d is None:
                continue
            targets = [p.params[name]] if self.stage == 3 else []
            targets += per_param
            if self.stage >= 2 and name in p.grads:
                targets.append(p.grads[name])
            for v in targets:
                state.try_apply(Tile(p.values[v].name, d, self.axis))
        return state


@register_tactic("FSDP")
@dataclass(frozen=True)
class FSDP(_OnOneAxis):
    def apply(self, state: ShardingState, context: Context | None = None) -> ShardingState:
        state = BatchParallel(self.axis).apply(state, context)
        return ZeRO(self.axis, 3).apply(state, context)


@dataclass(frozen=True)
class Manual:
    """`{glob: spec}`; a spec has one entry per dim: None, an axis, or a list of axes (major to minor)."""

    specs: dict = field(hash=False)
    searched: ClassVar[bool] = False

    @property
    def axes(self) -> tuple[str, ...]:
        named = [a for spec in self.specs.values() for e in spec if e is not None
                 for a in ([e] if isinstance(e, str) else e)]
        return tuple(dict.fromkeys(named))

    def text(self) -> str:
        return f"Manual({self.specs})"

    def apply(self, state: ShardingState, context: Context | None = None) -> ShardingState:
        p = state.program
        for glob, spec in self.specs.items():
            hits = [v for v in p.values if fnmatch.fnmatchcase(v.name, glob) and v.role is not Role.ACTIVATION]
            if not hits:
                raise ScheduleError(f"Manual spec {glob!r} matches no parameter, input or optimizer state")
            for v in hits:
                if len(spec) != len(v.shape):
                    raise ScheduleError(
                        f"Manual spec {spec} for {v.name} has {len(spec)} entries; the value has shape {list(v.shape)}"
                    )
                for d, entry in enumerate(spec):
                    for axis in [] if entry is None else [entry] if isinstance(entry, str) else entry:
                        state.apply(Tile(v.name, d, axis))
        return state
