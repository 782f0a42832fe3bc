"""The search's action space: what can be tiled on an axis, pruned by the propagation analysis.

Slots are found from roles and groups only (never names): every program input, every parameter group
(one slot for all repeated layers) or ungrouped parameter, and, when there is an optimizer, one
optimizer-sharding slot per parameter group (ZeRO: `ir.actions.ShardOptimizer`). A slot x dim x axis is a candidate
when the axis is not already used on the slot's value, not fenced there, and divides the dim (times the
axes already on it). Actions already implied by propagation are therefore never offered again.

`ShardOptimizer` (`ir/actions.py`, applied by `propagate/zero.py`) is the ZeRO move for one parameter group or
for every parameter.

A plan is an action list in canonical order (`rank`, `Plans`): parameter tiles, then input tiles, then ZeRO
moves and late parameter tiles (`TileLate`), each kind in the order chosen. Order is priority, so a search that
appends would need to pick a layer's tile before the batch split for that layer to run model-parallel on the
batch axis, and could not add it once the split is made: the U-Net's good plans tile several
low-resolution layers so (measured in docs/search.md, "Why the canonical order"). A plan's candidates are
judged where each would go (`Plans.candidates`), and adding one replays only the actions after its place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from partir_torch.errors import IllegalActionError
from partir_torch.ir.actions import ShardOptimizer, Tile, TileLate
from partir_torch.ir.actions import parse_action as ir_parse_action
from partir_torch.ir.program import Program, Role
from partir_torch.propagate import ShardingState
from partir_torch.propagate.zero import fits, zero_all


def parse_action(text: str) -> Action:
    """A search action back from its text (`str(action)`, as a plan's search log keeps it)."""
    try:
        action = ir_parse_action(text)
    except ValueError:
        action = None
    if not isinstance(action, Tile | TileLate | ShardOptimizer):
        raise ValueError(f"not a search action: {text!r} (expected tile(target, dim, axis[, late]) or "
                         "zeroN(target, dim, 'axis'))")
    return action


Action = Tile | TileLate | ShardOptimizer  # the search's moves (`Replicate` is not one)


@dataclass(frozen=True)
class Slot:
    """A target the search may tile: a value name or group key, its representative value, its kind."""

    target: str
    value: int
    kind: str  # input | param | optimizer


SIGNIFICANT = 1 / 64  # parameter slots smaller than this share of the largest one are left to propagation


def slots(program: Program) -> list[Slot]:
    """Inputs, parameter groups (one slot for all repeats) and ungrouped parameters, and optimizer slots.

    A parameter (group) whose size is below `SIGNIFICANT` of the largest one (biases, norm scales next to
    weight matrices) gets no slot of its own: deciding it moves the cost by little, while every slot
    multiplies the tree's branching; it is still sharded wherever propagation carries a decision to it.
    """
    out = [Slot(program.values[v].name, v, "input") for v in program.inputs if program.values[v].shape]
    grouped: set[str] = set()
    params: list[Slot] = []
    for g in program.groups:
        params.append(Slot(g.key, program.params[g.params[0]], "param"))
        grouped.update(g.params)
    trainable = set(program.grads)
    params += [Slot(n, v, "param") for n, v in program.params.items() if n not in grouped and n in trainable]
    largest = max((program.values[s.value].numel for s in params), default=0)
    out += [s for s in params if program.values[s.value].numel >= largest * SIGNIFICANT]
    if program.opt_states:
        out += [Slot(s.target, s.value, "optimizer") for s in list(out) if s.kind == "param"
                and program.values[s.value].name in program.opt_states]
    return out


@dataclass
class _Slots:
    """The search's slots of one analysis (`Analysis.stage`)."""

    slots: list[Slot]


@dataclass
class _DecidedBytes:
    """Each action's decided bytes by (target, ZeRO stage), per analysis (`Analysis.stage`)."""

    bytes: dict[tuple, int] = field(default_factory=dict)


def state_slots(state: ShardingState) -> list[Slot]:
    """`slots` of the state's program, computed once per analysis (`Analysis.stage`)."""
    an = state.analysis
    return an.stage(_Slots, lambda: _Slots(slots(an.program))).slots


def candidates(state: ShardingState, axes: tuple[str, ...], kinds: frozenset[str], *,
               prune: bool = True) -> list[Action]:
    """Legal, not-yet-implied actions on `axes` for slots of `kinds` (input, param, optimizer), sorted.

    `prune=False` (the ablation of `benchmarks/search.py`) skips the propagation analysis: every slot x dim
    x axis is offered, and every ZeRO stage on every dim, whatever the state, so implied actions (no-ops)
    and illegal ones (axis already used, fenced, not dividing) are among them; `apply_action` reports the
    illegal ones.
    """
    if not prune:
        return _all_actions(state, axes, kinds)
    out: list[Action] = []
    p = state.program
    if "optimizer" in kinds and p.opt_states:  # the whole-model ZeRO move, as the expert tactic does it
        free = [n for n, st in p.opt_states.items()
                if any(s not in p.shared_states and not state.shard[v].axes for s, v in st.items())]
        if free:  # and legal: some parameter's state (and, stage 3, the parameter) still divides
            out += [ShardOptimizer("*", -1, axis, stage) for axis in axes for stage in (1, 3)
                    if zero_all(state, axis, stage, first=True)]
    for s in state_slots(state):
        if s.kind not in kinds:
            continue
        st = ([v for n, v in p.opt_states[p.values[s.value].name].items() if n not in p.shared_states]
              if s.kind == "optimizer" else [])
        for axis in axes:
            have: set[int] = set()  # the ZeRO stages offered for this slot on this axis
            for d in range(len(p.values[s.value].shape)):
                if s.kind == "optimizer":  # one dim per stage: which one is tiled barely changes the cost
                    if st and 1 not in have and fits(state, st[0], d, axis):
                        out.append(ShardOptimizer(s.target, d, axis, 1))
                        have.add(1)
                    if st and 3 not in have and fits(state, st[0], d, axis) and fits(state, s.value, d, axis):
                        out.append(ShardOptimizer(s.target, d, axis, 3))
                        have.add(3)
                elif fits(state, s.value, d, axis):
                    out.append(Tile(s.target, d, axis))
    return out


def _all_actions(state: ShardingState, axes: tuple[str, ...], kinds: frozenset[str]) -> list[Action]:
    """Every syntactically possible action on `axes` for slots of `kinds`: what `candidates` prunes from."""
    out: list[Action] = []
    p = state.program
    if "optimizer" in kinds and p.opt_states:
        out += [ShardOptimizer("*", -1, axis, stage) for axis in axes for stage in (1, 3)]
    for s in state_slots(state):
        if s.kind not in kinds:
            continue
        for axis in axes:
            for d in range(len(p.values[s.value].shape)):
                if s.kind == "optimizer":
                    out += [ShardOptimizer(s.target, d, axis, stage) for stage in (1, 3)]
                else:
                    out.append(Tile(s.target, d, axis))
    return out


def decided_bytes(state: ShardingState, action: Action) -> int:
    """The bytes an action decides (the values it tiles): the search's prior, largest decision first. A
    property of shapes and roles only: the whole-model ZeRO move decides every optimizer state; an input's
    tile decides, through propagation, the activations computed from it, which its own bytes do not measure,
    so it counts the program's activation bytes on top of its own (inputs come first, larger first)."""
    p = state.program
    cache = state.analysis.stage(_DecidedBytes, _DecidedBytes).bytes
    key = (action.target, isinstance(action, ShardOptimizer) and action.stage)
    got = cache.get(key)
    if got is None:
        if isinstance(action, ShardOptimizer):
            names = (list(p.opt_states) if action.target == "*"
                     else [p.values[v].name for v in state.resolve(action.target)])
            got = sum(p.values[v].nbytes for n in names for s, v in p.opt_states.get(n, {}).items()
                      if s not in p.shared_states)
            if action.stage == 3:
                got += sum(p.values[p.params[n]].nbytes for n in names)
        else:
            vids = state.resolve(action.target)
            got = sum(p.values[v].nbytes for v in vids)
            if any(p.values[v].role is Role.INPUT for v in vids):
                got += sum(v.nbytes for v in p.values if v.role is Role.ACTIVATION)
        cache[key] = got
    return got


def apply_action(state: ShardingState, action: Action) -> bool:
    """Apply in place; False (state possibly half-changed: use a copy) when the action is illegal."""
    try:
        state.apply(action)
    except IllegalActionError:
        return False
    return True


def rank(program: Program, action: Action) -> int:
    """An action's place in a plan's canonical order: 0 a parameter's tile, 1 an input's tile, 2 a ZeRO move or
    a late tile (`TileLate`).

    Order is priority (an earlier decision is never undone), and the kinds differ in reach: a parameter's
    tile decides one layer's parallelism, an input's tile sweeps through every activation not yet decided, a
    ZeRO move fences every use of the parameters on its axis. Applied in this order, a layer tiled on the
    batch axis is that layer's model parallelism, with the rest of the network batch-parallel around it (the
    U-Net's mixed plans), whenever the search picks the layer. A layer tiled after the batch split is
    another decision, storage (GPT 6.7B's embedding on S2, docs/search.md): that is
    `TileLate`, offered once an input's tile uses the axis."""
    if isinstance(action, ShardOptimizer | TileLate):
        return 2
    return 1 if action.target in program.input_names else 0


def place(program: Program, actions, action: Action | int) -> int:
    """Where `action` (or an action of that rank) goes in `actions`, a plan in canonical order: after every
    action of its rank or lower."""
    r, i = action if isinstance(action, int) else rank(program, action), len(actions)
    while i and rank(program, actions[i - 1]) > r:
        i -= 1
    return i


class Plans:
    """Plans as action lists in canonical order (`rank`), built from `root`: `extend` inserts an action at its
    place and replays what follows from the state of the prefix (`prefix`: a bounded cache; most extensions
    append and need no replay). `applied` counts the actions applied (propagated), `time_s` their time."""

    def __init__(self, root: ShardingState, size: int = 256, memo: int = 512) -> None:
        self.root, self.size = root, size
        self.cache: dict[tuple, ShardingState] = {}
        # every plan's state (None: illegal), most recent last: a plan's state depends only on its actions,
        # and the search replays the same plans again (rollouts, the refinement). Apart from `cache`, whose
        # contents (and so the count of actions applied, the refinement's budget) stay what they were
        self.memo: dict[tuple, ShardingState | None] = {}
        self.memo_size = memo
        self.applied, self.time_s = 0, 0.0

    def apply(self, state: ShardingState, action: Action) -> ShardingState | None:
        """`action` applied to a copy of `state`; None when illegal."""
        t0 = time.perf_counter()
        self.applied += 1
        s = state.copy()
        ok = apply_action(s, action)
        self.time_s += time.perf_counter() - t0
        return s if ok else None

    def _step(self, state: ShardingState, plan: tuple, action: Action) -> ShardingState | None:
        """`apply(state, action)` where `plan` (the actions of `state`, then `action`) names the result: served
        by the memo when it holds it, counted as applied either way."""
        if plan in self.memo:
            self.applied += 1
            got = self.memo.pop(plan)
        else:
            got = self.apply(state, action)
            if self.memo and len(self.memo) >= self.memo_size:
                del self.memo[next(iter(self.memo))]
        if self.memo_size > 0:
            self.memo[plan] = got
        return got

    def prefix(self, actions: tuple) -> ShardingState | None:
        """The state of `actions` applied in the order given (None: illegal), from the cache where it can."""
        if not actions:
            return self.root
        got = self.cache.get(actions)
        if got is None:
            base = self.prefix(actions[:-1])
            got = None if base is None else self._step(base, actions, actions[-1])
            if got is not None:
                self._keep(actions, got)
        return got

    def _keep(self, actions: tuple, state: ShardingState) -> None:
        if self.size <= 0:
            return
        if len(self.cache) >= self.size:
            del self.cache[next(iter(self.cache))]  # the oldest
        self.cache[actions] = state

    def extend(self, state: ShardingState, actions: list[Action], action: Action
               ) -> tuple[ShardingState, list[Action]] | None:
        """The plan of `actions` (whose state is `state`) with `action` at its place; None when illegal."""
        got = self.extend_many(state, actions, [action])
        return None if got is None or len(got[1]) == len(actions) else got

    def candidates(self, state: ShardingState, actions: list[Action], axes: tuple[str, ...], kinds: frozenset[str],
                   *, prune: bool = True) -> list[Action]:
        """`candidates` of the plan of `actions` (state `state`), each action judged where `extend` puts it: a
        parameter's tile against the plan's parameter tiles alone, an input's before its ZeRO moves."""
        if not prune:
            return candidates(state, axes, kinds, prune=False)
        p, n = state.program, len(actions)
        out: list[Action] = []
        at: dict[int, list[Action]] = {}
        for r in (0, 1, 2):
            i = place(p, actions, r)
            if i not in at:
                s = state if i == n else self.prefix(tuple(actions[:i]))
                at[i] = [] if s is None else candidates(s, axes, kinds)
            out += [a for a in at[i] if rank(p, a) == r]
        # a parameter's tile after an input's on the same axis differs from the placed one: offered as well
        swept = {a.axis for a in actions if rank(p, a) == 1}
        if swept:
            out += [TileLate(a.target, a.dim, a.axis) for a in at[n] if isinstance(a, Tile) and rank(p, a) == 0
                    and a.axis in swept]
        return out

    def extend_many(self, state: ShardingState, actions: list[Action], extra: list[Action]
                    ) -> tuple[ShardingState, list[Action]] | None:
        """The plan of `actions` with each of `extra` at its place, replayed once from the first place; an
        action of `extra` that is illegal there is left out (None only if one of `actions` becomes illegal)."""
        p = state.program
        new, mine = list(actions), set(extra)
        for a in extra:
            new.insert(place(p, new, a), a)
        first = next((i for i, a in enumerate(new) if i >= len(actions) or a != actions[i]), len(new))
        s = state if first == len(actions) else self.prefix(tuple(new[:first]))
        out = new[:first]
        for j, a in enumerate(new[first:], first):  # the prefixes are kept: candidates are judged at them
            if s is None:
                return None
            nxt = self._step(s, (*out, a), a)
            if nxt is None and a in mine:
                continue  # an extra action that is illegal here: left out
            s = nxt
            out.append(a)
            if s is not None and j < len(new) - 1:
                self._keep(tuple(out), s)
        return None if s is None else (s, out)

    def replay(self, actions, start: ShardingState | None = None) -> ShardingState | None:
        """`actions` applied in the order given, to `start` (default: the root); None when one is illegal."""
        s, done = (self.root, ()) if start is None else (start, None)
        for a in actions:
            if done is None:
                s = self.apply(s, a)
            else:
                done = (*done, a)
                s = self._step(s, done, a)
            if s is None:
                return None
        return s


def replay(root: ShardingState, actions) -> ShardingState | None:
    """The plan of `actions` applied in order to a copy of `root`; None when one of them is illegal."""
    return Plans(root, size=0, memo=0).replay(actions)
