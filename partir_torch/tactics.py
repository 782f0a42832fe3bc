"""Manual tactics and schedules: the expert strategies, written as actions plus propagation.

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
import math
import re
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from partir_torch.errors import IllegalActionError, PartirError
from partir_torch.ir.actions import Tile
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Phase, Program, Role
from partir_torch.ir.sharding import divides, tile_count
from partir_torch.propagate import ShardingState
from partir_torch.rules.tables import CASTS, LINEAR, PAIR_STOPS, TRANSPOSES


class ScheduleError(PartirError):
    """A schedule names an unknown tactic or axis, or cannot be parsed."""


INTERRUPTED = threading.Event()  # set by Ctrl-C during a search: the schedule's later tactics are not applied


@dataclass
class Context:
    """What a tactic gets beside the state: the search's configuration (`search.api.SearchConfig`, read by
    `Auto`; None: its defaults), and `blocked`, where a tactic says why values it meant to shard stayed
    replicated (the schedule's warning)."""

    search: Any = None
    blocked: list[str] = field(default_factory=list)


class Tactic(Protocol):
    """One entry of a schedule. `searched`: it searches its axes (each axis is searched at most once);
    `axes`: the axes it decides (None: every axis the earlier tactics left free)."""

    searched: ClassVar[bool]

    @property
    def axes(self) -> tuple[str, ...] | None: ...

    def apply(self, state: ShardingState, context: Context | None = None) -> ShardingState: ...

    def text(self) -> str: ...


# lower-case name -> reads `axes` (None for `*`) and the arguments of a schedule entry into a tactic
_REGISTRY: dict[str, Callable[[tuple[str, ...] | None, list[str]], Tactic]] = {}


def register_tactic(*names: str):
    """Class decorator: the schedule text calls the class's `from_text(axes, args)` for these names."""

    def deco(cls):
        for n in names:
            _REGISTRY[n.lower()] = cls.from_text
        return cls

    return deco


def registered_tactics() -> list[str]:
    return sorted(_REGISTRY)


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


_ENTRY = re.compile(r"([\w,+*]+)\s*:\s*([A-Za-z_]+?)(\d)?\s*(?:\((.*)\))?")


def parse_schedule(text: str, mesh: Mesh) -> list[Tactic]:
    """`"batch:BatchParallel;model:Megatron;batch:ZeRO(1)"` -> tactics; axes are checked against the mesh.

    An entry is `axes:Name[digit][(arguments)]`, `axes` one axis, several (`batch,model`) or `*`; the name
    is looked up in the registry (`register_tactic`), whose entry reads the axes and arguments."""
    out: list[Tactic] = []
    for part in filter(None, (s.strip() for s in text.split(";"))):
        if part.lower() == "fallback":  # an option of the schedule, not a tactic (`wants_fallback`)
            continue
        m = _ENTRY.fullmatch(part)
        if not m:
            raise ScheduleError(f"cannot parse schedule entry {part!r}; write axis:Tactic, e.g. batch:BatchParallel")
        axes_text, name, digit, arg_text = m.groups()
        names = [a for a in re.split(r"[,+]", axes_text) if a]
        if names != ["*"]:
            for a in names:
                if a not in mesh.names:
                    raise ScheduleError(f"schedule entry {part!r} names axis {a!r}; the mesh has axes "
                                        f"{list(mesh.names)}")
        make = _REGISTRY.get(name.lower())
        if make is None:
            raise ScheduleError(
                f"unknown tactic {name!r} in {part!r}; known: BatchParallel (DP), Megatron, ZeRO(1|2|3), FSDP, "
                "Auto(goal) with goal time|communication|zero"
            )
        args = [x.strip() for x in (arg_text or "").split(",") if x.strip()]
        try:
            out.append(make(None if names == ["*"] else tuple(names), ([digit] if digit else []) + args))
        except PartirError as e:
            raise ScheduleError(f"{part!r}: {e}") from None
    if not out:
        raise ScheduleError("empty schedule")
    _check_reuse(out, mesh, text)
    return out


def _check_reuse(tactics: list[Tactic], mesh: Mesh, text: str) -> None:
    """A tactic may build on an earlier one on the same axis (DP then ZeRO), but not repeat it, and an
    axis is searched at most once."""
    seen: set[tuple[str, str]] = set()
    searched: set[str] = set()
    for t in tactics:
        if t.searched:
            axes = t.axes or tuple(a for a in mesh.names if a not in {ax for ax, _ in seen})
            again = searched.intersection(axes)
            if again:
                raise ScheduleError(f"schedule {text!r} searches axis {sorted(again)[0]!r} twice; give each axis one "
                                    "Auto")
            searched.update(axes)
            continue
        for axis in t.axes or ():
            key = (axis, type(t).__name__)
            if key in seen:
                raise ScheduleError(f"schedule {text!r} applies {key[1]} on axis {key[0]!r} twice")
            seen.add(key)


def wants_fallback(schedule: str | list | None) -> bool:
    """A schedule text with a `fallback` entry (`"fallback;batch:BatchParallel"`) runs ops without rules
    replicated, as `fallback=True` does."""
    return isinstance(schedule, str) and any(p.strip().lower() == "fallback" for p in schedule.split(";"))


def warn_fallbacks(state: ShardingState) -> list[str]:
    """One warning per op without a rule (run replicated): the op, its module and source line, and the
    collectives its replicated operands add to the plan. Returns the messages."""
    from partir_torch.lower import lower
    from partir_torch.rules.base import rule_name, where

    p = state.program
    fell = {op.id for op in p.ops if rule_name(op.target) is None}
    if not fell:
        return []
    added: dict[int, list] = {}
    for c in lower(state):
        if c.op in fell:
            added.setdefault(c.op, []).append(c)
    by: dict[tuple[str, str], list[int]] = {}
    for o in sorted(fell):
        by.setdefault((p.ops[o].target, where(p.ops[o])), []).append(o)
    msgs = []
    for (target, place), ops in by.items():
        cs = [c for o in ops for c in added.get(o, [])]
        kinds = sorted({f"{c.kind} on {c.axis!r}" for c in cs})
        cost = (f"adds {len(cs)} collective(s), {sum(c.bytes for c in cs)} bytes per device ({', '.join(kinds)})"
                if cs else "adds no communication under this plan (its operands are replicated already)")
        msgs.append(f"no tile-mapping rule for {target} ({len(ops)} op(s), {place}): it runs replicated "
                    f"(fallback) and {cost}; add a rule in partir_torch/rules/<family>.py to shard it")
    for m in msgs:
        warnings.warn(m, stacklevel=3)
    return msgs


def warn_misplaced(state: ShardingState) -> list[str]:
    """One warning per pair of axes whose order on a shared dim makes reads gather whole
    (`lower.misplaced_reads`): a schedule's later tactic puts its axis minor on a dim an earlier one tiled, so
    applying the tactic of the axis read first makes each read a gather of the other alone. Returns them."""
    from partir_torch.lower import misplaced_reads

    msgs = []
    for (keep, ahead), rows in misplaced_reads(state).items():
        total = sum(r[3] for r in rows)
        shown = "; ".join(f"{n} held {s} read {d}" for n, s, d, _ in rows[:3])
        more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
        msgs.append(f"axis order: {len(rows)} value(s) are held tiled by {ahead!r} ahead of {keep!r} on a dim but "
                    f"read with {keep!r} further ahead ({shown}{more}): each device's block of the dim changes, so "
                    f"they are gathered whole and sliced again (these reads move {total / 2**30:.2f} GiB per device "
                    f"a step); apply the tactic that tiles {keep!r} before the one that tiles {ahead!r} (e.g. "
                    f"'{keep}:Megatron;{ahead}:FSDP'), so that {keep!r} is the major axis of the dim")
    for m in msgs:
        warnings.warn(m, stacklevel=3)
    return msgs


def _warn_small_budget(config, entries: list[dict], elapsed: float) -> None:
    """A time budget the search overran (each sub-search runs at least one episode) was too small to search."""
    seconds = config.budget.seconds
    if seconds is None or not entries or elapsed <= 2 * seconds:
        return
    episodes = sum(e.get("episodes", 0) for e in entries)
    warnings.warn(f"search budget {seconds:g} s is too small for this program: the search ran {episodes} episode(s) "
                  f"(at least one per sub-search) in {elapsed:.2f} s, and the plan is what those found; give it more "
                  f"time (e.g. --budget {max(10, math.ceil(20 * elapsed))}s) or a number of episodes", stacklevel=3)


def apply_schedule(program: Program, mesh: Mesh, schedule: str | list, *, fallback: bool = False,
                   search=None) -> ShardingState:
    """Apply a schedule to a fresh state. Ops without rules are decomposed first (`state.program` may then
    be a re-traced program). `search` (a `SearchConfig`) sets the cost model and budget of `Auto` tactics.
    An axis may be claimed by several tactics (DP then ZeRO on `batch`); each builds on the earlier ones."""
    from partir_torch.rules.decompose import prepare

    fallback = fallback or wants_fallback(schedule)
    tactics = parse_schedule(schedule, mesh) if isinstance(schedule, str) else schedule
    state = ShardingState(prepare(program, fallback=fallback), mesh, fallback=fallback)
    context = Context(search)
    INTERRUPTED.clear()
    for i, t in enumerate(tactics):
        if INTERRUPTED.is_set():  # Ctrl-C in an earlier search: the later tactics are not applied
            warnings.warn(f"search interrupted (Ctrl-C): the plan is the best found so far; "
                          f"{', '.join(type(x).__name__ for x in tactics[i:])} not applied", stacklevel=2)
            break
        before = list(state.shard)
        context.blocked.clear()
        try:
            n0, t0 = len(search.log) if search is not None else 0, time.perf_counter()
            state = t.apply(state, context)
            if t.searched and search is not None:  # no config: Auto's default, a number of episodes
                _warn_small_budget(search, search.log[n0:], time.perf_counter() - t0)
        except IllegalActionError as e:
            raise ScheduleError(f"{type(t).__name__} on {','.join(t.axes or ('*',))!r}: {e}") from e
        if t.searched:
            continue
        name = f"{type(t).__name__} on {','.join(t.axes or ('*',))!r}"
        blocked = context.blocked
        if state.shard == before:
            why = "; ".join(blocked[:4]) or "there is nothing for it to shard in this program"
            warnings.warn(f"{name} changes nothing: {why}", stacklevel=2)
        elif blocked:
            warnings.warn(f"{name} left {len(blocked)} value(s) replicated: {'; '.join(blocked[:4])}", stacklevel=2)
    if INTERRUPTED.is_set() and tactics and tactics[-1].searched:
        warnings.warn("search interrupted (Ctrl-C): the plan is the best found so far", stacklevel=2)
    INTERRUPTED.clear()  # consumed: a later search in this process runs in full
    if fallback:
        warn_fallbacks(state)
    if not all(t.searched for t in tactics):  # a searched plan pays for its axis orders knowingly
        warn_misplaced(state)
    return state
