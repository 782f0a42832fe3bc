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
"""

from __future__ import annotations

import fnmatch
import math
import re
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

from partir_torch.errors import IllegalActionError, PartirError
from partir_torch.ir.actions import Tile
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Phase, Program, Role
from partir_torch.propagate import ShardingState


class ScheduleError(PartirError):
    """A schedule names an unknown tactic or axis, or cannot be parsed."""


@dataclass(frozen=True)
class BatchParallel:
    axis: str

    def apply(self, state: ShardingState) -> list[str]:
        """Tile dim 0 of every input; returns why inputs stayed replicated (for `apply_schedule`'s warning)."""
        blocked = []
        for v in state.program.inputs:
            val = state.program.values[v]
            if val.shape and not state.try_apply(Tile(val.name, 0, self.axis)) and self.axis not in state.shard[v].axes:
                blocked.append(_why(state, v, 0, self.axis))
        return blocked


_LINEAR = {"aten.mm.default": (0, 1), "aten.addmm.default": (1, 2)}  # (lhs, rhs) operand positions
_STOP = {"aten.native_layer_norm.default", "aten.native_group_norm.default", "aten.mean.dim",
         "aten.sum.dim_IntList", "aten.embedding.default"}
_TRANSPOSES = {"aten.t.default", "aten.transpose.int", "aten.permute.default"}


_CASTS = {"aten._to_copy.default", "prims.convert_element_type.default"}  # dtype casts (autocast's)


def _uncast(program: Program, rules, v: int) -> int:
    """The value `v` is a dtype cast of (autocast casts the weight of each linear), else `v`."""
    while (prod := program.values[v].producer) >= 0 and program.ops[prod].target in _CASTS \
            and program.values[v].shape == program.values[rules[prod].operands[0].value].shape:
        v = rules[prod].operands[0].value
    return v


def linears(program: Program, rules) -> dict[int, tuple[int, int, int]]:
    """Forward linears: op id -> (weight parameter, its output-features dim, its input-features dim)."""
    params = set(program.params.values())
    out = {}
    for op in program.ops:
        if op.phase is not Phase.FORWARD or op.target not in _LINEAR:
            continue
        rhs = _uncast(program, rules, rules[op.id].operands[_LINEAR[op.target][1]].value)
        if rhs in params and len(program.values[rhs].shape) == 2:
            out[op.id] = (rhs, 1, 0)  # x @ W with W [in, out]
            continue
        prod = program.values[rhs].producer
        if prod >= 0 and program.ops[prod].target in _TRANSPOSES:
            w = _uncast(program, rules, rules[prod].operands[0].value)
            if w in params and len(program.values[w].shape) == 2:
                out[op.id] = (w, 0, 1)  # x @ W.T with W [out, in] (nn.Linear)
    return out


def megatron_pairs(program: Program, rules) -> list[tuple[int, int]]:
    """(column linear, row linear) op pairs, by forward data flow from each linear's output."""
    lin = linears(program, rules)
    lhs_of = {rules[o].operands[_LINEAR[program.ops[o].target][0]].value: o for o in lin}
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
                if uop.target in _STOP or any(i in params for i in uop.inputs):
                    continue
                todo.extend((r, depth + 1) for r in uop.outputs if r >= 0)
        for u in dict.fromkeys(found):
            pairs.append((o, u))
            rows.add(u)
    return pairs


@dataclass(frozen=True)
class Megatron:
    axis: str

    def apply(self, state: ShardingState) -> list[str]:
        p, lin = state.program, linears(state.program, state.rules)
        pairs = megatron_pairs(p, state.rules)
        if not pairs:
            return [f"no column/row pair of linears was found ({len(lin)} forward linears; a pair is a linear whose "
                    "output feeds another's input without a normalization or reduction between them)"]
        blocked = []
        for col, row in pairs:
            w1, out1, _ = lin[col]
            w2, _, in2 = lin[row]
            for w, d in ((w1, out1), (w2, in2)):
                if not state.try_apply(Tile(p.values[w].name, d, self.axis)) and self.axis not in state.shard[w].axes:
                    blocked.append(_why(state, w, d, self.axis))
        return blocked


def _why(state: ShardingState, v: int, d: int, axis: str) -> str:
    """Why `v` could not be tiled on `axis` along `d`, and what would help."""
    val, k = state.program.values[v], state.mesh.size(axis)
    n = val.shape[d]
    for a in state.shard[v].dims[d]:
        k *= state.mesh.size(a)
    if n % k:
        return (f"{val.name} dim {d} has size {n}, not divisible by {k} (axis {axis!r}); use a size divisible by "
                f"{k} (e.g. {n + (-n) % k}) or a smaller axis")
    if axis in state.locked[v]:
        return f"{val.name} is replicated on {axis!r} by an earlier tactic"
    return f"{val.name} dim {d} conflicts with an earlier decision on {axis!r} (sharding {state.shard[v]})"


def _free_dim(state: ShardingState, v: int, axis: str) -> int | None:
    val, sh = state.program.values[v], state.shard[v]
    if axis in sh.axes:
        return None
    k = state.mesh.size(axis)
    for d, size in enumerate(val.shape):
        n = k
        for a in sh.dims[d]:
            n *= state.mesh.size(a)
        if size % n == 0 and size >= n:
            return d
    return None


@dataclass(frozen=True)
class ZeRO:
    axis: str
    stage: int = 1

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ScheduleError(f"ZeRO stage must be 1, 2 or 3, got {self.stage}")

    def apply(self, state: ShardingState) -> None:
        """Fence the forward and backward passes on `axis` (ZeRO changes only what the optimizer holds and
        reads; a sharded parameter is all-gathered where it is used), then tile states, grads, params."""
        p = state.program
        grads = set(p.grads.values())
        fenced = [v for op in p.ops if op.phase is not Phase.OPTIMIZER for v in op.outputs
                  if v >= 0 and not (self.stage >= 2 and v in grads)]
        state.lock(fenced, self.axis)
        if self.stage < 3:
            state.lock(p.params.values(), self.axis)
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


@dataclass(frozen=True)
class FSDP:
    axis: str

    def apply(self, state: ShardingState) -> None:
        BatchParallel(self.axis).apply(state)
        ZeRO(self.axis, 3).apply(state)


@dataclass(frozen=True)
class Manual:
    """`{glob: spec}`; a spec has one entry per dim: None, an axis, or a list of axes (major to minor)."""

    specs: dict = field(hash=False)

    def apply(self, state: ShardingState) -> None:
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


Tactic = BatchParallel | Megatron | ZeRO | FSDP | Manual
_BY_NAME = {"batchparallel": BatchParallel, "dp": BatchParallel, "megatron": Megatron, "zero": ZeRO, "fsdp": FSDP}


def parse_schedule(text: str, mesh: Mesh) -> list[Tactic]:
    """`"batch:BatchParallel;model:Megatron;batch:ZeRO(1)"` -> tactics; axes are checked against the mesh."""
    out: list[Tactic] = []
    for part in filter(None, (s.strip() for s in text.split(";"))):
        if part.lower() == "fallback":  # an option of the schedule, not a tactic (`wants_fallback`)
            continue
        auto = re.fullmatch(r"([\w,+*]+)\s*:\s*auto\s*(?:\(\s*(\w+)?\s*(?:,\s*(\w+)\s*)?\))?", part, re.I)
        if auto:
            from partir_torch.search.api import Auto

            names = [a for a in re.split(r"[,+]", auto.group(1)) if a]
            if names != ["*"]:
                for a in names:
                    if a not in mesh.names:
                        raise ScheduleError(f"schedule entry {part!r} names axis {a!r}; the mesh has axes {list(mesh.names)}")
            try:
                out.append(Auto(None if names == ["*"] else tuple(names), auto.group(2) or "time", auto.group(3) or "both"))
            except PartirError as e:
                raise ScheduleError(f"{part!r}: {e}") from None
            continue
        m = re.fullmatch(r"(\w+)\s*:\s*(\w+?)(\d)?\s*(?:\((?:stage\s*=\s*)?(\d)\))?", part)
        if not m:
            raise ScheduleError(f"cannot parse schedule entry {part!r}; write axis:Tactic, e.g. batch:BatchParallel")
        axis, name, digit, arg = m.groups()
        if axis not in mesh.names:
            raise ScheduleError(f"schedule entry {part!r} names axis {axis!r}; the mesh has axes {list(mesh.names)}")
        cls = _BY_NAME.get(name.lower())
        if cls is None:
            raise ScheduleError(
                f"unknown tactic {name!r} in {part!r}; known: BatchParallel (DP), Megatron, ZeRO(1|2|3), FSDP, "
                "Auto(goal) with goal time|communication|zero"
            )
        stage = digit or arg
        out.append(cls(axis, int(stage)) if cls is ZeRO and stage else cls(axis))
    if not out:
        raise ScheduleError("empty schedule")
    _check_reuse(out, mesh, text)
    return out


def _check_reuse(tactics: list, mesh: Mesh, text: str) -> None:
    """A tactic may build on an earlier one on the same axis (DP then ZeRO), but not repeat it, and an
    axis is searched at most once."""
    seen: set[tuple[str, str]] = set()
    searched: set[str] = set()
    for t in tactics:
        if type(t).__name__ == "Auto":
            axes = t.axes or tuple(a for a in mesh.names if a not in {ax for ax, _ in seen})
            again = searched.intersection(axes)
            if again:
                raise ScheduleError(f"schedule {text!r} searches axis {sorted(again)[0]!r} twice; give each axis one Auto")
            searched.update(axes)
            continue
        key = (t.axis, type(t).__name__)
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
    from partir_torch.search.api import Auto
    from partir_torch.search.mcts import INTERRUPTED

    fallback = fallback or wants_fallback(schedule)
    tactics = parse_schedule(schedule, mesh) if isinstance(schedule, str) else schedule
    state = ShardingState(prepare(program, fallback=fallback), mesh, fallback=fallback)
    INTERRUPTED.clear()
    for t in tactics:
        if INTERRUPTED.is_set():  # Ctrl-C in an earlier search: the later tactics are not applied
            warnings.warn(f"search interrupted (Ctrl-C): the plan is the best found so far; "
                          f"{', '.join(type(x).__name__ for x in tactics[tactics.index(t):])} not applied", stacklevel=2)
            break
        before = list(state.shard)
        try:
            if isinstance(t, Auto):
                n0, t0 = len(search.log) if search is not None else 0, time.perf_counter()
                t.apply(state, search)  # no config: Auto's default, a number of episodes
                if search is not None:
                    _warn_small_budget(search, search.log[n0:], time.perf_counter() - t0)
                continue
            blocked = t.apply(state) or []
        except IllegalActionError as e:
            raise ScheduleError(f"{type(t).__name__} on {getattr(t, 'axis', '?')!r}: {e}") from e
        name = f"{type(t).__name__} on {getattr(t, 'axis', '?')!r}"
        if state.shard == before:
            why = "; ".join(blocked[:4]) or "there is nothing for it to shard in this program"
            warnings.warn(f"{name} changes nothing: {why}", stacklevel=2)
        elif blocked:
            warnings.warn(f"{name} left {len(blocked)} value(s) replicated: {'; '.join(blocked[:4])}", stacklevel=2)
    if INTERRUPTED.is_set() and tactics and isinstance(tactics[-1], Auto):
        warnings.warn("search interrupted (Ctrl-C): the plan is the best found so far", stacklevel=2)
    INTERRUPTED.clear()  # consumed: a later search in this process runs in full
    if fallback:
        warn_fallbacks(state)
    return state
