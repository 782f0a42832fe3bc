"""Schedules: the `Tactic` protocol and its registry, the schedule text, applying a schedule, and the
decisions a state records so that replaying them rebuilds it exactly (`replay`).

A tactic is a sequence of actions (PartIR): a manual tactic is a function from a state to the actions it
takes (`actions(state, context)`, `ir.actions`: tiles, replications, ZeRO moves), applied in order by
`take`; the search's tactic (`search.api.Auto`, `searched`) returns the state its search found, whose
actions are the search's. So a schedule, an expert composite the search starts from and a searched plan are
all action lists, and a new expert strategy is written once (`experts.py`). The schedule text is read
through a registry (`register_tactic`): a tactic class registers its names and reads its own arguments, so
this module names no tactic of a later layer.

A state's `actions` are its decisions in order. `replay` applies them to a fresh state; a plan saves them
as text (`str(action)`, `ir.actions.parse_action` reads them back) and replays them to rebuild the state it
was costed on (`plan.ShardingPlan.to_state`).
"""

from __future__ import annotations

import difflib
import re
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from partir_torch.errors import IllegalActionError, PartirError
from partir_torch.ir.actions import Action, Tile, TileLate
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Program
from partir_torch.ir.sharding import divides, tile_count
from partir_torch.propagate import ShardingState


class ScheduleError(PartirError):
    """A schedule names an unknown tactic or axis, or cannot be parsed."""


S = TypeVar("S")


@dataclass
class Context(Generic[S]):
    """One application of a schedule, as its tactics see it beside the state:
    - `search`: the search's options (a `search.api.SearchConfig`, read by `Auto`; None: its defaults);
    - `cancel`: the cancellation token: Ctrl-C during a search sets it, the search ends with its best plan
      and the schedule's later tactics are not applied (one token per application: nothing carries over);
    - `log`: what the searched tactics did, one entry per sub-search (axes, goal, actions, statistics), and
      `trace`: each entry's actions (the search's result, read by the plan and the benchmarks);
    - `blocked`: where a tactic says why values it meant to shard stayed replicated (the schedule's warning)."""

    search: S | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    log: list[dict[str, Any]] = field(default_factory=list)
    trace: list[list] = field(default_factory=list, repr=False)
    blocked: list[str] = field(default_factory=list)


class Tactic(Protocol):
    """One entry of a schedule. `axes`: the axes it decides (None: every axis the earlier tactics left free).
    A manual tactic (`searched` False) has `actions(state, context) -> list[Action]` (and `strict`: an
    illegal action of it is an error, not a value left replicated); a searched one (each axis is searched at
    most once) has `apply(state, context) -> state`."""

    searched: ClassVar[bool]

    @property
    def axes(self) -> tuple[str, ...] | None: ...

    def text(self) -> str: ...


def take(state: ShardingState, actions: Iterable[Action], context: Context | None = None, *,
         strict: bool = False) -> ShardingState:
    """Apply a manual tactic's actions in order. An illegal one is a `ScheduleError` when `strict`, else
    skipped, and why the values it meant to shard stayed replicated goes to `context.blocked`."""
    for a in actions:
        try:
            state.apply(a)
        except (IllegalActionError, PartirError) as e:
            if strict:
                raise ScheduleError(f"{a}: {e}") from e
            if context is not None:
                context.blocked.extend(_why_not(state, a, e))
    return state


def _why_not(state: ShardingState, action: Action, error: Exception) -> list[str]:
    """Why `action` could not be applied, per value it meant to tile (none when propagation tiled it anyway)."""
    if not isinstance(action, Tile | TileLate):
        return [str(error)]
    first = next((v for v in state.resolve(action.target) if action.axis not in state.shard[v].axes), None)
    return [] if first is None else [why_not_tiled(state, first, action.dim, action.axis)]


def why_not_tiled(state: ShardingState, v: int, d: int, axis: str) -> str:
    """Why `v` could not be tiled on `axis` along `d`, and what would help."""
    val, n = state.program.values[v], state.program.values[v].shape[d]
    k = tile_count(state.mesh, (*state.shard[v].dims[d], axis))
    if not divides(n, state.mesh, (*state.shard[v].dims[d], axis)):
        return (f"{val.name} dim {d} has size {n}, not divisible by {k} (axis {axis!r}); use a size divisible by "
                f"{k} (e.g. {n + (-n) % k}) or a smaller axis")
    if axis in state.locked[v]:
        return f"{val.name} is replicated on {axis!r} by an earlier tactic"
    return f"{val.name} dim {d} conflicts with an earlier decision on {axis!r} (sharding {state.shard[v]})"


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
                    near = difflib.get_close_matches(a, list(mesh.names), n=1, cutoff=0.6)
                    hint = (f"; is the mesh's {near[0]!r} a typo of {a!r}? Name the axis the same in both"
                            if near else "")
                    raise ScheduleError(f"schedule entry {part!r} names axis {a!r}; the mesh has axes "
                                        f"{list(mesh.names)}{hint}")
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


def apply_schedule(program: Program, mesh: Mesh, schedule: str | list, *, fallback: bool = False,
                   search: object = None, context: Context | None = None) -> ShardingState:
    """Apply a schedule to a fresh state. Ops without rules are decomposed first (`state.program` may then
    be a re-traced program). `search` (a `SearchConfig`) sets the cost model and budget of `Auto` tactics;
    or pass a `context` (`Context(config)`) to read the search's log from it afterwards, or to cancel it.
    An axis may be claimed by several tactics (DP then ZeRO on `batch`); each builds on the earlier ones."""
    from partir_torch.rules.decompose import prepare

    fallback = fallback or wants_fallback(schedule)
    tactics = parse_schedule(schedule, mesh) if isinstance(schedule, str) else schedule
    state = ShardingState(prepare(program, fallback=fallback), mesh, fallback=fallback)
    if context is None:
        context = Context(search)
    elif search is not None:
        raise TypeError("apply_schedule takes `search` or a `context` holding it, not both")
    for i, t in enumerate(tactics):
        if context.cancel.is_set():  # Ctrl-C in an earlier search: the later tactics are not applied
            warnings.warn(f"search interrupted (Ctrl-C): the plan is the best found so far; "
                          f"{', '.join(type(x).__name__ for x in tactics[i:])} not applied", stacklevel=2)
            break
        before = list(state.shard)
        context.blocked.clear()
        try:
            if t.searched:
                state = t.apply(state, context)
            else:
                state = take(state, t.actions(state, context), context, strict=t.strict)
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
    if context.cancel.is_set() and tactics and tactics[-1].searched:
        warnings.warn("search interrupted (Ctrl-C): the plan is the best found so far", stacklevel=2)
    if fallback:
        warn_fallbacks(state)
    if not all(t.searched for t in tactics):  # a searched plan pays for its axis orders knowingly
        warn_misplaced(state)
    return state


# -- decisions ---------------------------------------------------------------------------------------------
def replay(program: Program, mesh: Mesh, decisions: list[Action], *, fallback: bool = False) -> ShardingState:
    """A fresh state with `decisions` (a state's `actions`, or a plan's parsed back by `parse_action`) applied
    in order: the same state, propagation being a function of the decisions and their order."""
    from partir_torch.rules.decompose import prepare

    state = ShardingState(prepare(program, fallback=fallback), mesh, fallback=fallback)
    for d in decisions:
        state.apply(d)
    return state
