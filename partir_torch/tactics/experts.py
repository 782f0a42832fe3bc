"""The manual tactics: the expert strategies, each a function from a state to the actions it takes.

A schedule is applied in order, each tactic's actions to their fixpoint; later tactics never undo earlier
decisions. Text form: `"batch:BatchParallel;model:Megatron;batch:ZeRO(1)"` (`ZeRO3`, `FSDP`, `DP` also read).

- BatchParallel(axis): tile dim 0 of every program input that divides.
- Megatron(axis): column/row pairs found from the program's structure: a linear (mm/addmm whose weight
  operand is a parameter, possibly transposed) whose output reaches another linear's input through ops that
  are not linears, normalizations or reductions. The first is tiled on its output features, the second on
  its input features (one tile per parameter group: every repeated layer at once). No name is read.
- ZeRO(axis, stage): the ZeRO action for every parameter (`ShardOptimizer("*", -1, axis, stage)`):
  optimizer states (1), plus gradients (2), plus parameters (3) tiled on `axis` along their first divisible
  dim, the forward and backward fenced so the optimizer's sharding does not leak into the model's
  computation: sharded parameters are all-gathered where they are used, gradients reduce-scattered.
- FSDP(axis) = BatchParallel(axis) then ZeRO(axis, 3).
- HSDP(outer, inner): hybrid sharded data parallelism, as torch's FSDP2 `HSDP` / DeepSpeed's hpZ: the batch
  over both axes, parameters, gradients and optimizer states sharded over `inner` only (the fast axis, within
  a node), replicated across `outer` (a `:dcn` axis), so only the gradients' reduction crosses nodes.
- ExpertParallel(axis): GShard's expert parallelism: every stacked expert weight (a rank-3 parameter that a
  forward batched matmul reads with its batch dim as the expert dim, `[E, d, f]`) tiled on that dim; tokens
  reach their experts through the all-to-all propagation places where the batch-split activations meet the
  expert-split ones. Experts kept as separate modules (a `ModuleList` of linears) are not stacked weights
  and are left to the other tactics.
- SequenceParallel(axis): the sequence dim (dim 1) of every token or embedding input (rank 2 or 3) tiled on
  `axis`. After `Megatron` on the same axis it is Megatron's sequence parallelism: the norms, dropouts and
  residuals between a row and the next column linear run on a sequence tile, the row linear's all-reduce
  becomes a reduce-scatter and the column linear's input an all-gather. On an axis of its own it is context
  parallelism in its all-gather form: every op runs on a sequence tile, attention gathers its keys and values.
- Manual({glob: spec}): per-value specs in torch_xla's partition-spec form.

The same functions give the search its expert composites to start from (`search/seeds.py`).
"""

from __future__ import annotations

import fnmatch
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from partir_torch.ir.actions import Action, ShardOptimizer, Tile
from partir_torch.ir.program import Phase, Program, Role
from partir_torch.ir.sharding import divides
from partir_torch.propagate import ShardingState
from partir_torch.rules.tables import CASTS, LINEAR, PAIR_STOPS, TRANSPOSES
from partir_torch.tactics.schedule import Context, ScheduleError, register_tactic, take, why_not_tiled


class _Taken:
    """A manual tactic applied on its own: its actions taken on `state` (`schedule.take`), as a schedule does."""

    strict: ClassVar[bool] = False  # an action that cannot be applied leaves its values replicated, with why

    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        raise NotImplementedError

    def apply(self, state: ShardingState, context: Context | None = None) -> ShardingState:
        return take(state, self.actions(state, context), context, strict=self.strict)


@dataclass(frozen=True)
class _OnOneAxis(_Taken):
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
    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        """A tile of dim 0 of every input that divides; why another input stays replicated goes to
        `context.blocked`."""
        return batch_tiles(state, self.axis, context.blocked if context is not None else None)


def batch_tiles(state: ShardingState, axis: str, blocked: list[str] | None = None) -> list[Action]:
    """The data-parallel tiles of `axis`: dim 0 of every input that divides (with the axes already on it)."""
    p, out = state.program, []
    for v in p.inputs:
        val = p.values[v]
        if not val.shape or axis in state.shard[v].axes:
            continue
        if divides(val.shape[0], state.mesh, (*state.shard[v].dims[0], axis)):
            out.append(Tile(val.name, 0, axis))
        elif blocked is not None:
            blocked.append(why_not_tiled(state, v, 0, axis))
    return out


def _uncast(program: Program, rules, v: int) -> int:
    """The value `v` is a dtype cast of (autocast casts the weight of each linear), else `v`."""
    while (prod := program.values[v].producer) >= 0 and program.ops[prod].target in CASTS \
            and program.values[v].shape == program.values[rules[prod].operands[0].value].shape:
        v = rules[prod].operands[0].value
    return v


def _weight(program: Program, rules, v: int, params: set[int], out_dim: int) -> int | None:
    """The 2-D parameter `v` is (through casts), or the one `v` is an equal part of, split along its
    output-features dim `out_dim` (`nn.MultiheadAttention`'s packed q/k/v weight, `capture/attention.py`:
    the split reads it in chunks, so tiling that dim tiles every part alike); else None."""
    v = _uncast(program, rules, v)
    if v not in params:
        prod = program.values[v].producer
        if prod < 0 or not rules[prod].operands or [d for d, _ in rules[prod].operands[0].chunks] != [out_dim]:
            return None
        v = _uncast(program, rules, rules[prod].operands[0].value)
    return v if v in params and len(program.values[v].shape) == 2 else None


def linears(program: Program, rules) -> dict[int, tuple[int, int, int]]:
    """Forward linears: op id -> (weight parameter, its output-features dim, its input-features dim)."""
    params = set(program.params.values())
    out = {}
    for op in program.ops:
        if op.phase is not Phase.FORWARD or op.target not in LINEAR:
            continue
        rhs = rules[op.id].operands[LINEAR[op.target][1]].value
        if (w := _weight(program, rules, rhs, params, 1)) is not None:
            out[op.id] = (w, 1, 0)  # x @ W with W [in, out]
            continue
        prod = program.values[_uncast(program, rules, rhs)].producer
        if prod >= 0 and program.ops[prod].target in TRANSPOSES:
            w = _weight(program, rules, rules[prod].operands[0].value, params, 0)
            if w is not None:
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
    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        """A tile per column/row weight (its group's: every repeated layer at once); why there is none goes
        to `context.blocked`."""
        p = state.program
        tiles = megatron_tiles(state, self.axis)
        if not tiles and context is not None:  # (why: the pairs again, only on this rare path)
            n = len(linears(p, state.rules))
            context.blocked.append(f"no column/row pair of linears was found ({n} forward linears; a pair is a linear "
                                   "whose output feeds another's input without a normalization or reduction "
                                   "between them)" if not megatron_pairs(p, state.rules) else
                                   "no column/row weight divides by the axis")
        return [Tile(group_of(p, p.values[w].name), d, self.axis) for w, d in tiles]


def megatron_tiles(state: ShardingState, axis: str) -> list[tuple[int, int]]:
    """(weight, dim) of every column/row pair's weights whose dim divides by `axis`, one per parameter group
    (the first member: tiling a group's key tiles all its members), in the pairs' order."""
    p, lin = state.program, linears(state.program, state.rules)
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for col, row in megatron_pairs(p, state.rules):
        for w, d in ((lin[col][0], lin[col][1]), (lin[row][0], lin[row][2])):
            if divides(p.values[w].shape[d], state.mesh, (axis,)):
                out.setdefault((group_of(p, p.values[w].name), d), (w, d))
    return list(out.values())


def group_of(program: Program, name: str) -> str:
    """The key of the parameter group `name` belongs to (`h.*.mlp.c_fc.weight`), else `name`."""
    for g in program.groups:
        if name in g.params:
            return g.key
    return name


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

    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        """One action: ZeRO of every parameter with optimizer state (`ShardOptimizer("*")`, `propagate/zero.py`)."""
        return [ShardOptimizer("*", -1, self.axis, self.stage)]


@register_tactic("FSDP")
@dataclass(frozen=True)
class FSDP(_OnOneAxis):
    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        return [*BatchParallel(self.axis).actions(state, context), *ZeRO(self.axis, 3).actions(state, context)]


@register_tactic("SequenceParallel", "SP", "ContextParallel", "CP")
@dataclass(frozen=True)
class SequenceParallel(_OnOneAxis):
    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        """A tile of dim 1 of every rank-2 or rank-3 input that divides (tokens `[B, T]`, embeddings
        `[B, T, d]`); why another stays whole goes to `context.blocked`."""
        p, out = state.program, []
        for v in p.inputs:
            val = p.values[v]
            if len(val.shape) not in (2, 3) or self.axis in state.shard[v].axes:
                continue
            if divides(val.shape[1], state.mesh, (*state.shard[v].dims[1], self.axis)):
                out.append(Tile(val.name, 1, self.axis))
            elif context is not None:
                context.blocked.append(why_not_tiled(state, v, 1, self.axis))
        return out


@register_tactic("ExpertParallel", "EP")
@dataclass(frozen=True)
class ExpertParallel(_OnOneAxis):
    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        """A tile of the expert dim of every stacked expert weight (its group's); why there is none goes to
        `context.blocked`."""
        p = state.program
        found = expert_weights(p, state.rules)
        out = list(dict.fromkeys(Tile(group_of(p, p.values[w].name), 0, self.axis) for w in found
                                 if divides(p.values[w].shape[0], state.mesh, (self.axis,))))
        if not out and context is not None:
            context.blocked.append(f"no stacked expert weight divides by {self.axis!r} ({len(found)} found: a rank-3 "
                                   "parameter a forward batched matmul reads with its batch dim as the expert dim)")
        return out


def expert_weights(program: Program, rules) -> list[int]:
    """Rank-3 parameters (through dtype casts) that a forward `bmm` reads as an operand: their dim 0 is the
    matmul's batch dim, one slice per expert (`[E, d, f]` stacked weights, as GShard / Switch store them)."""
    params, out = set(program.params.values()), []
    for op in program.ops:
        if op.phase is not Phase.FORWARD or op.target != "aten.bmm.default":
            continue
        for t in rules[op.id].operands:
            v = _uncast(program, rules, t.value)
            if v in params and len(program.values[v].shape) == 3 and v not in out:
                out.append(v)
    return out


@register_tactic("HSDP")
@dataclass(frozen=True)
class HSDP(_Taken):
    """`outer,inner:HSDP`: data parallel over both axes, FSDP (ZeRO-3) over `inner` only."""

    outer: str
    inner: str
    searched: ClassVar[bool] = False

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.outer, self.inner)

    @classmethod
    def from_text(cls, axes: tuple[str, ...] | None, args: list[str]) -> HSDP:
        if axes is None or len(axes) != 2 or args:
            raise ScheduleError(f"HSDP takes two axes, the replicated one first (e.g. node,gpu:HSDP), and no "
                                f"arguments; got {', '.join(axes or ('*',))} {args or ''}".rstrip())
        return cls(*axes)

    def text(self) -> str:
        return f"{self.outer},{self.inner}:HSDP"

    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        return [*BatchParallel(self.outer).actions(state, context), *FSDP(self.inner).actions(state, context)]


@dataclass(frozen=True)
class Manual(_Taken):
    """`{glob: spec}`; a spec has one entry per dim: None, an axis, or a list of axes (major to minor)."""

    specs: dict = field(hash=False)
    searched: ClassVar[bool] = False
    strict: ClassVar[bool] = True  # a spec that cannot be applied is an error

    @property
    def axes(self) -> tuple[str, ...]:
        named = [a for spec in self.specs.values() for e in spec if e is not None
                 for a in ([e] if isinstance(e, str) else e)]
        return tuple(dict.fromkeys(named))

    def text(self) -> str:
        return f"Manual({self.specs})"

    def actions(self, state: ShardingState, context: Context | None = None) -> list[Action]:
        p, out = state.program, []
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
                        out.append(Tile(v.name, d, axis))
        return out
