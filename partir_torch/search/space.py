"""The search's action space: what can be tiled on an axis, pruned by the propagation analysis.

Slots are found from roles and groups only (never names): every program input, every parameter group
(one slot for all repeated layers) or ungrouped parameter, and, when there is an optimizer, one
optimizer-sharding slot per parameter group (ZeRO: `ShardOptimizer`). A slot x dim x axis is a candidate
when the axis is not already used on the slot's value, not fenced there, and divides the dim (times the
axes already on it). Actions already implied by propagation are therefore never offered again.

`ShardOptimizer(target, dim, axis, stage)` is the ZeRO move for one parameter group (or, with target `*`,
for every parameter at once, each on its first dim that divides: the expert's move, which a model with
dozens of distinct layers could not reach one group at a time): the group's per-
parameter optimizer states (stage 1), and its parameters (stage 3) are tiled on `dim`, while the forward and
backward ops that read the parameter or write its gradient are fenced on the axis (their other tensors kept
as they are), so the optimizer's sharding does not leak into the model: a stage-3 parameter is gathered
where it is used and its gradient reduce-scattered, exactly as `tactics.ZeRO` does for all parameters. One
exception (`_kept_tiled`): a re-layout of the parameter (a linear's weight transpose) read in the forward only
by ops that another parameter of the move already tiles the same way (the linear's bias) stays tiled, and the
backward reads it tiled too: gathering it would hand the op a tile it slices again.

A plan is an action list in canonical order (`rank`, `Plans`): parameter tiles, then input tiles, then ZeRO
moves and late parameter tiles (`TileLate`), each kind in the order chosen. Order is priority, so a search that
appends would need to pick a layer's tile before the batch split for that layer to run model-parallel on the
batch axis, and could not add it once the split is made: the U-Net's good plans tile several
low-resolution layers so (measured in docs/search.md, "Why the canonical order"). A plan's candidates are
judged where each would go (`Plans.candidates`), and adding one replays only the actions after its place.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from partir_torch.errors import IllegalActionError
from partir_torch.ir.actions import Tile
from partir_torch.ir.program import Phase, Program, Role
from partir_torch.ir.sharding import divides
from partir_torch.propagate import MOVES, ShardingState


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
        p = state.program
        if self.target == "*":  # every parameter with optimizer state, each on its first dim that divides
            chosen = _zero_all(state, self.axis, self.stage)
            if not chosen:
                raise IllegalActionError(f"no optimizer state left to shard on {self.axis!r}")
            self._fence(state, chosen)  # all fences first: no tile may leak past a later fence
            for name, d in chosen:
                self._tiles(state, [name], d)
            state.actions.append(self)
            return
        members = [p.values[v].name for v in state.resolve(self.target)]
        for name in members:
            if name not in p.opt_states:
                raise IllegalActionError(f"{name} has no optimizer state to shard")
        self._fence(state, [(n, self.dim) for n in members])
        self._tiles(state, members, self.dim)
        state.actions.append(self)

    def _fence(self, state: ShardingState, chosen: list[tuple[str, int]]) -> None:
        p = state.program
        fence: set[int] = set()
        own: set[int] = set()
        members = [n for n, _ in chosen]
        for name in members:
            own.update(v for v in (p.params[name], p.grads.get(name)) if v is not None)
        if self.stage == 3:
            own |= _kept_tiled(state, dict((p.params[n], d) for n, d in chosen), self.axis)
        for v in own:
            for o in state.touch[v]:
                if p.ops[o].phase is Phase.OPTIMIZER:
                    continue
                for t in (*state.rules[o].operands, *state.rules[o].results):
                    fence.add(t.value)
        fence -= own
        if self.stage < 3:
            fence |= own
        state.lock(fence, self.axis)

    def _tiles(self, state: ShardingState, members: list[str], dim: int) -> None:
        p = state.program
        for name in members:
            states = [v for s, v in p.opt_states[name].items() if s not in p.shared_states]
            targets = ([p.params[name]] if self.stage == 3 else []) + states
            for v in targets:
                if self.axis in state.shard[v].axes:
                    continue
                state.apply(Tile(p.values[v].name, dim, self.axis))


@dataclass(frozen=True, order=True)
class TileLate:
    """A parameter group's tile applied after the inputs' tiles (with the ZeRO moves, `rank` 2). Where an
    input's tile has already decided a layer's ops on the axis, the parameter is then only stored sharded:
    gathered where it is used, while propagation carries the tiling on into its gradient's producers and its
    optimizer update (unlike the stage-3 ZeRO move, which fences them); where it has not, it is `Tile`."""

    target: str
    dim: int
    axis: str

    def __str__(self) -> str:
        return f"tile({self.target}, {self.dim}, {self.axis}, late)"

    def apply(self, state: ShardingState) -> None:
        state.apply(Tile(self.target, self.dim, self.axis))


_TILE = re.compile(r"tile\((?P<target>.+), (?P<dim>-?\d+), (?P<axis>[^,()]+)(?P<late>, late)?\)")
_ZERO = re.compile(r"zero(?P<stage>\d)\((?P<target>.+), (?P<dim>-?\d+), '(?P<axis>[^']+)'\)")


def parse_action(text: str) -> Tile | TileLate | ShardOptimizer:
    """An action back from its text (`str(action)`, as a plan's search log keeps it)."""
    if m := _TILE.fullmatch(text):
        cls = TileLate if m["late"] else Tile
        return cls(m["target"], int(m["dim"]), m["axis"])
    if m := _ZERO.fullmatch(text):
        return ShardOptimizer(m["target"], int(m["dim"]), m["axis"], int(m["stage"]))
    raise ValueError(f"not a search action: {text!r} (expected tile(target, dim, axis[, late]) or "
                     "zeroN(target, dim, 'axis'))")


def _kept_tiled(state: ShardingState, tiled: dict[int, int], axis: str) -> set[int]:
    """The re-layouts (transposes, views) of stage-3 parameters that stay tiled: those of a parameter that the
    forward reads only through them, by ops that already run on that tiling from another parameter of the
    move (a linear's weight transpose when its bias, tiled on the same output dim, makes the addmm
    column-parallel). Gathering such a re-layout only hands the op a tile it slices again, and keeps the
    whole weight for the backward, which can run on the tile and sum its partial input gradient instead (what
    GSPMD does given the parameters tiled). A parameter the forward gathers anyway keeps every re-layout
    fenced: the engine reuses the gathered copy in the backward; so does one whose reader the tiles already
    placed (the batch split) run on another factor of `axis`."""
    p, rules = state.program, state.rules
    kept: set[int] = set()
    for pv, d in tiled.items():
        chain, frontier, ok, reads = [], [(pv, d)], True, 0
        while frontier and ok:
            v, dv = frontier.pop()
            for o in state.touch[v]:
                op, rule = p.ops[o], rules[o]
                if op.phase is Phase.OPTIMIZER or o == p.values[v].producer:
                    continue
                if rule.name in MOVES and len(rule.operands) == 1 and len(rule.results) == 1:
                    f = rule.operands[0].dims[dv]
                    out = rule.results[0]
                    if f is None or f not in out.dims:
                        ok = False
                        break
                    chain.append(out.value)
                    frontier.append((out.value, out.dims.index(f)))
                elif op.phase is Phase.FORWARD:
                    f = None if v == pv else next((t.dims[dv] for t in rule.operands if t.value == v), None)
                    if f is None or not any(t.value != v and t.value in tiled and t.dims[tiled[t.value]] == f
                                            for t in rule.operands) or not _runs_on(state, o, f, axis):
                        ok = False
                        break
                    reads += 1
        if ok and reads and chain:
            kept.update(chain)
    return kept


def _runs_on(state: ShardingState, o: int, f: int, axis: str) -> bool:
    """Whether op `o` may run with factor `f` on `axis`: not assigned another, and no tensor of it tiled on `axis`
    on a dim that does not carry `f`."""
    if state.factor_of(o, axis) not in (None, f):
        return False
    rule = state.rules[o]
    for t in (*rule.operands, *rule.results):
        d = state.shard[t.value].dim_of(axis)
        if d is not None and t.dims[d] != f:
            return False
    return True


def _zero_all(state: ShardingState, axis: str, stage: int, first: bool = False) -> list[tuple[str, int]]:
    """What `ShardOptimizer("*", -1, axis, stage)` tiles: (parameter, its first dim that divides); `first`:
    stop at the first one (is the move legal?)."""
    p = state.program
    chosen = []
    for name, st in p.opt_states.items():
        per = [v for s, v in st.items() if s not in p.shared_states]
        pv = p.params[name]
        for d in range(len(p.values[pv].shape)):
            if per and _fits(state, per[0], d, axis) and (stage < 3 or _fits(state, pv, d, axis)):
                chosen.append((name, d))
                if first:
                    return chosen
                break
    return chosen


Action = Tile | TileLate | ShardOptimizer


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


def state_slots(state: ShardingState) -> list[Slot]:
    """`slots` of the state's program, computed once per analysis (`Analysis.search_slots`)."""
    an = state.analysis
    if an.search_slots is None:
        an.search_slots = slots(an.program)
    return an.search_slots


def _fits(state: ShardingState, v: int, dim: int, axis: str) -> bool:
    val, sh = state.program.values[v], state.shard[v]
    if axis in sh.axes or axis in state.locked[v]:
        return False
    return divides(val.shape[dim], state.mesh, (*sh.dims[dim], axis))


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
                    if _zero_all(state, axis, stage, first=True)]
    for s in state_slots(state):
        if s.kind not in kinds:
            continue
        st = ([v for n, v in p.opt_states[p.values[s.value].name].items() if n not in p.shared_states]
              if s.kind == "optimizer" else [])
        for axis in axes:
            have: set[int] = set()  # the ZeRO stages offered for this slot on this axis
            for d in range(len(p.values[s.value].shape)):
                if s.kind == "optimizer":  # one dim per stage: which one is tiled barely changes the cost
                    if st and 1 not in have and _fits(state, st[0], d, axis):
                        out.append(ShardOptimizer(s.target, d, axis, 1))
                        have.add(1)
                    if st and 3 not in have and _fits(state, st[0], d, axis) and _fits(state, s.value, d, axis):
                        out.append(ShardOptimizer(s.target, d, axis, 3))
                        have.add(3)
                elif _fits(state, s.value, d, axis):
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
    cache = state.analysis.decided_bytes
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
        if isinstance(action, ShardOptimizer | TileLate):
            action.apply(state)
        else:
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
