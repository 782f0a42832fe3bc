"""Local search over plans: prune, hill-climb, walk plateaus. The tree search (`mcts.py`) refines its best
plans with it; it also runs alone from given plans (`LocalSearch.refine` with `starts`).

The refinement (the last `refine` share of an MCTS budget): rollouts leave incidental actions in the best plan, and
the tree rarely reaches the last small improvements. So a local search runs from each of the `elite`
best distinct plans seen, best first, and from `starts` (plans of other searches, see `Auto` "both"):
  (1) prune: each action whose removal keeps the plan within `simplicity` of the best step time found
      (or no worse than the plan itself) is dropped, newest first (`simplify`);
  (2) hill-climb: the best of the neighbours one move away is taken while it improves the plan by more than
      `simplicity` (or makes it fit). The moves, by groups, a group tried only when none before improves:
      (a) add one candidate action at its place (on a wide plan, more than `widen_above` candidates, they are tried
      in the order of their mean reward in the episodes, MAST, and the first that improves is taken: on
      a wide plan an append scan costs a propagation per candidate); (b) replace one action by another on the same slot
      (another dim, ZeRO stage, or ZeRO instead of a tile); (c) insert one action before an action that
      made it illegal (a ZeRO move fences the parameters on its axis, a tile propagates its axis; the
      orders of the tree are not commutative), first before the ZeRO moves, the candidates ordered by
      the tree's scores of the shorter plan with them; the first insertion that improves is taken (the
      costly group);
  (3) at a local optimum, walk the plateau: each plan as good as it with one parameter tile replaced by
      another slot's (the same decision reached from another layer: S5's edge MLP and decoder weights, both
      on the latent dim) is hill-climbed in turn (`_twins`): other moves are legal after the other tile;
and the best result (with the `simplicity` margin, the first start winning ties) is the answer. The
refinement's budget is counted in applied actions (each replay applies the plan's actions again). Under a
time budget, a refinement that reaches its local optimum early hands the time left back to the tree (then
refines again), so the budget is spent searching.
Sharding more than a plan needs costs what the cost model does not see (more collectives to launch, more to
debug) and the model is not exact: a decision must earn its place.
The plans' scores are `goals.Score`s; `Score.beats` is the one comparison with the `simplicity` margin.
"""

from __future__ import annotations

import threading
import time

from partir_torch.ir.actions import ShardOptimizer
from partir_torch.propagate import ShardingState
from partir_torch.search.budget import Stats
from partir_torch.search.goals import WORST, Evaluator, Score
from partir_torch.search.space import Action, Plans, place, rank

Plan = tuple[Score, ShardingState, list[Action]]
Fingerprint = tuple  # the decisions themselves (compared on a hash collision, never merged by hash alone)


def simplify(replay, ev: Evaluator, plan: Plan, ref: Score, simplicity: float, spent=lambda: False,
             seen=None) -> Plan:
    """Drop each action of `plan` = (key, state, actions), newest first, whose removal keeps it as good or
    within `simplicity` of the step time of `ref` (the best found), in passes until one drops nothing: a
    decision must earn its place.
    `replay(actions)` makes a plan's state (None: illegal); `seen(key, state, actions)` sees each trial."""
    key, state, acts = plan
    dropped = True
    while dropped:  # again while a pass drops something (an action may earn its place only beside another)
        dropped, i = False, len(acts) - 1
        while i >= 0 and not spent():
            trial = acts[:i] + acts[i + 1:]
            s = replay(trial)
            if s is not None:
                k, _ = ev.score(s, frozenset(trial))
                if seen is not None:
                    seen(k, s, trial)
                if k.keeps(key, ref, simplicity):
                    key, state, acts, dropped = k, s, trial, True
            i -= 1
    return key, state, acts




def fingerprint(state: ShardingState, decided: list[int]) -> Fingerprint:
    """The decisions of a state: shardings and fences of the `decided` values (parameters, inputs,
    optimizer states)."""
    sh, lk = state.shard, state.locked
    return tuple([(sh[v], lk[v]) for v in decided])


class LocalSearch:
    """The best plans seen (`best`, `elite`) and the local search from them. `mast` (action -> [sum of
    rewards, episodes]) orders the candidates of wide plans, when a tree search provides it."""

    def __init__(self, plans: Plans, evaluator: Evaluator, axes: tuple[str, ...], kinds: frozenset[str], *,
                 prune: bool = True, simplicity: float = 0.005, elite: int = 4, widen: float | None = 3.0,
                 widen_above: int = 128, stats: Stats | None = None,
                 mast: dict[Action, list[float]] | None = None, cancel: threading.Event | None = None) -> None:
        self.plans, self.ev, self.axes, self.kinds = plans, evaluator, axes, kinds
        self.cancel = cancel if cancel is not None else threading.Event()  # set: stop, keep the best so far
        self.prune, self.simplicity, self.elite_size = prune, simplicity, elite
        self.widen, self.widen_above = widen, widen_above
        self.stats = stats if stats is not None else Stats()
        self.mast = mast if mast is not None else {}
        root = plans.root
        self._decided = [v.id for v in root.program.values if v.producer < 0]
        ref, _ = self.ev.score(root, frozenset())
        self.best: Plan = (ref, root, [])
        self.elite: dict[Fingerprint, Plan] = {}  # the best distinct plans seen

    def _fingerprint(self, state: ShardingState) -> Fingerprint:
        return fingerprint(state, self._decided)

    def _plan_print(self, state: ShardingState, acts: list[Action]) -> Fingerprint:
        """The decisions of a plan and its parameter tiles (`space.rank` 0): plans that propagate to the same
        shardings differ in what may follow when their parameter tiles differ, since an action added later
        is placed after those (S5: the edge MLP's or the decoder's weight tiled on the latent dim give the same
        shardings; only the decoder's leaves the edge MLP's ZeRO-3 move legal before it). The refinement tells
        plans apart so (`_twins`); the tree merges them (transpositions by shardings alone, measured in
        docs/search.md)."""
        p = state.program
        return (frozenset(a for a in acts if rank(p, a) == 0), self._fingerprint(state))

    def _wide_list(self, cands: list[Action]) -> bool:
        return self.widen is not None and len(cands) > self.widen_above

    def _candidates(self, state: ShardingState, acts: list[Action]) -> list[Action]:
        """The candidates of the plan `acts` (state `state`), each judged at its place (`Plans.candidates`)."""
        return self.plans.candidates(state, acts, self.axes, self.kinds, prune=self.prune)

    def consider(self, key: Score, state: ShardingState, actions: list[Action]) -> None:
        """Keep `actions` if it is the best plan so far, or one of the `elite` best distinct ones."""
        if key < self.best[0]:
            self.best = (key, state, actions)
            self.stats.best_at_episode = self.stats.episodes
        el = self.elite
        if len(el) >= self.elite_size and key >= max(e[0] for e in el.values()):
            return
        fp = self._plan_print(state, actions)
        if fp in el:
            if key < el[fp][0] or (key == el[fp][0] and len(actions) < len(el[fp][2])):
                el[fp] = (key, state, actions)
            return
        el[fp] = (key, state, actions)
        if len(el) > self.elite_size:
            del el[max(el, key=lambda f: el[f][0])]


    def refine(self, deadline: float | None, max_evals: int | None, starts: list[list[Action]] | None = None) -> None:
        """Local search from the best plans found (see the module docstring): each is pruned, then hill-climbed;
        the best result, in the goal's order with the `simplicity` margin, becomes the answer.

        `starts`: action lists (from the root) to refine as well, e.g. the plans of other searches. Replaying
        them is charged to the deadline, not to `max_evals` (the climbs' budget)."""
        applied0 = self.plans.applied  # the refinement's budget unit: actions applied (and propagated)

        def late() -> bool:
            return (deadline is not None and time.perf_counter() >= deadline) or self.cancel.is_set()

        def spent() -> bool:
            return late() or (max_evals is not None and self.plans.applied - applied0 >= max_evals)

        pool = sorted(self.elite.values(), key=lambda e: e[0])
        plans: list[Plan] = []
        for acts in starts or []:
            if late():  # the starts are tried in the order given
                break
            s = self.plans.replay(acts)
            if s is not None:
                k, _ = self.ev.score(s, frozenset(acts))
                self.consider(k, s, list(acts))
                plans.append((k, s, list(acts)))
        applied0 = self.plans.applied
        plans = sorted(plans + pool, key=lambda e: e[0])
        seen: set[Fingerprint] = set()  # starts, and plans already hill-climbed
        ref = self.best[0]  # prune towards the best step time found
        answer = None
        for key, state, acts in plans:
            fp = self._plan_print(state, acts)
            if fp in seen or spent():
                continue
            got = self._local_search(key, state, acts, ref, spent, seen)
            if got is None:
                continue
            if answer is None or got[0].beats(answer[0], self.simplicity):
                answer = got
        if answer is not None:
            self.best = answer

    def _local_search(self, key: tuple, state: ShardingState, acts: list[Action], ref: tuple, spent,
                      seen: set[Fingerprint]) -> Plan | None:
        key, state, acts = simplify(self.plans.replay, self.ev, (key, state, acts), ref, self.simplicity, spent,
                                    self.consider)
        # within `simplicity` of the best found, with fewer decisions; now hill-climb (unless done from here)
        fp = self._plan_print(state, acts)
        if fp in seen:
            return None
        seen.add(fp)
        best, todo = (key, state, acts), [(key, state, acts)]
        while todo and not spent():  # each local optimum, then its twins (a plateau walk, `_twins`)
            got = self._climb(*todo.pop(0), spent)
            if got[0].beats(best[0], self.simplicity):
                best = got
            for k, s, trial in self._twins(*got, spent):
                fp = self._plan_print(s, trial)
                if fp not in seen:
                    seen.add(fp)
                    todo.append((k, s, trial))
        return best

    def _climb(self, key: tuple, state: ShardingState, acts: list[Action], spent) -> tuple:
        """Hill-climb: the best neighbour (`_neighbours`) while one improves."""
        while not spent():
            step = None
            cands = self._candidates(state, acts)
            wide = self._wide_list(cands)
            for group, trial, s in self._neighbours(state, acts, cands, spent):
                if step is not None and group > step[3]:
                    break  # an append improves: the costlier moves are not needed
                k, _ = self.ev.score(s, frozenset(trial))
                self.consider(k, s, trial)
                if k.beats(key, self.simplicity) and (step is None or k < step[0]):
                    step = (k, s, trial, group)
                    if group == 2 or (group == 0 and wide):
                        break  # the costly moves, or appends on a wide node: take the first that improves
            if step is None:
                break
            key, state, acts = step[:3]
        return key, state, acts

    def _twins(self, key: tuple, state: ShardingState, acts: list[Action], spent):
        """Plans as good as a local optimum with one parameter tile replaced by another slot's: the same
        decision reached from another layer (S5: the edge MLP's or the decoder's weight tiled on the latent
        dim propagates to the same plan) leaves other moves legal (there, the edge MLP's ZeRO-3 move inserted
        before the decoder's tile). Not on a wide plan (more than `widen_above` candidates a position)."""
        p = state.program
        for i, a in enumerate(acts):
            if rank(p, a) != 0:
                continue
            pre = self.plans.prefix(tuple(acts[:i]))
            if pre is None:
                return
            cands = self._candidates(pre, acts[:i])
            if self._wide_list(cands):
                return
            for c in cands:
                if rank(p, c) != 0 or c.target == a.target or c in acts:
                    continue
                if spent():
                    return
                trial = [*acts[:i], c, *acts[i + 1:]]
                s = self.plans.replay(trial[i:], pre)
                if s is None:
                    continue
                k, _ = self.ev.score(s, frozenset(trial))
                self.consider(k, s, trial)
                if k <= key:
                    yield k, s, trial

    def _neighbours(self, state: ShardingState, acts: list[Action], cands: list[Action], spent):
        """Plans one move from `acts`, by groups, each tried only if no move of the groups before improves:
        (0) one candidate action added at its place; (1) one action replaced by another on the same slot (another dim,
        ZeRO stage, or ZeRO instead of a tile); (2) one action inserted before an action that makes it illegal
        (a ZeRO move fences the parameters on its axis, a tile propagates its axis): first before the ZeRO
        moves, then before each other action, last to first, each position's actions in the order of the
        tree's scores of the shorter plan with that action; the first that improves is taken.
        `cands`: the candidates of `acts` (`_candidates`)."""
        have, after = set(acts), set(cands)
        if self._wide_list(cands):  # too many to try all: the actions the episodes rewarded most first
            mast = self.mast
            cands = sorted(cands, key=lambda a: -mast[a][0] / mast[a][1] if a in mast else 0.0)
        for a in cands:
            if spent():
                return
            got = self.plans.extend(state, acts, a)
            if got is not None:
                yield 0, got[1], got[0]
        prefixes = [self.plans.prefix(tuple(acts[:i])) for i in range(len(acts))]  # the plan of acts[:i]
        if any(s is None for s in prefixes):
            return
        for i, a in enumerate(acts):  # another decision for the same slot (a dim, a ZeRO stage, tile or ZeRO)
            for c in self._candidates(prefixes[i], acts[:i]):
                if c.target != a.target or c == a or c in have:
                    continue
                if spent():
                    return
                rest = [*acts[:i], *acts[i + 1:]]
                j = place(state.program, rest, c)
                trial = [*rest[:j], c, *rest[j:]]  # at its place in the canonical order
                k = min(i, j)
                s = self.plans.replay(trial[k:], prefixes[k])
                if s is not None:
                    yield 1, trial, s
        fences = [i for i, a in enumerate(acts) if isinstance(a, ShardOptimizer)]
        for i in fences + [i for i in reversed(range(len(acts))) if i not in fences]:
            # the tree's scores of `acts[:i] + [c]`, where it has them, order the trials (best first)
            cache, worst = self.ev.cache, WORST
            cands = [c for c in self._candidates(prefixes[i], acts[:i]) if c not in after and c not in have]
            cands.sort(key=lambda c: cache.get(frozenset([*acts[:i], c]), worst))
            for c in cands:
                if spent():
                    return
                trial = [*acts[:i], c, *acts[i:]]
                s = self.plans.replay(trial[i:], prefixes[i])
                if s is not None:
                    yield 2, trial, s

