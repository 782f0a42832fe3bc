"""Baselines for the MCTS, in the same harness (same action space, evaluator, budget and Result):

    random      sample action sequences of random length (1..max_depth), keep the best
    greedy      from the start, apply the single best action; repeat while that improves the plan
    beam        breadth-first over action sets, keeping the `width` best states per depth
    exhaustive  every set of up to `max_depth` actions (small programs only): the optimum of the space,
                to measure the optimality gap of the others
Each answer but the exhaustive one is simplified as the MCTS's is (`local.simplify`: an action whose
removal keeps the plan within 0.5 % of the best step time found is dropped; a few evaluations after the
budget), so that all are judged by the same objective.
"""

from __future__ import annotations

import random
import time

from partir_torch.propagate import ShardingState
from partir_torch.search.budget import Budget, Result, Stats
from partir_torch.search.goals import Evaluator
from partir_torch.search.local import simplify
from partir_torch.search.space import Action, Plans, candidates


class _Run:
    def __init__(self, root: ShardingState, ev: Evaluator, budget: Budget) -> None:
        self.ev, self.budget, self.t0 = ev, budget, time.perf_counter()
        self.stats, self.ev0, self.ct0 = Stats(), ev.evaluations, ev.cost_time_s
        k, _ = ev.score(root, frozenset())
        self.best: tuple[tuple, ShardingState, list[Action]] = (k, root, [])
        self.plans = Plans(root)  # the same canonical order of actions as the MCTS (space.rank)

    def spent(self) -> bool:
        b = self.budget
        return ((b.episodes is not None and self.stats.episodes >= b.episodes)
                or (b.seconds is not None and time.perf_counter() - self.t0 >= b.seconds))

    def step(self, state: ShardingState, acts: list[Action], a: Action
             ) -> tuple[tuple, ShardingState, list[Action]] | None:
        """The plan of `acts` (state `state`) with `a` at its place: (score, state, actions), None if illegal."""
        got = self.plans.extend(state, acts, a)
        if got is None:
            return None
        s, new = got
        k, _ = self.ev.score(s, frozenset(new))
        self.stats.episodes += 1
        self.stats.nodes += 1
        if k < self.best[0]:
            self.best = (k, s, new)
            self.stats.best_at_episode = self.stats.episodes
        return k, s, new

    def result(self, simplicity: float = 0.005) -> Result:
        """The best plan, simplified by the rule of the MCTS refinement (`local.simplify`): the same objective."""
        self.best = simplify(self.plans.replay, self.ev, self.best, self.best[0], simplicity)
        self.stats.time_s = time.perf_counter() - self.t0
        self.stats.propagation_time_s = self.plans.time_s
        self.stats.evaluations = self.ev.evaluations - self.ev0
        self.stats.cost_time_s = self.ev.cost_time_s - self.ct0
        k, s, acts = self.best
        return Result(s, acts, k, self.stats)


def random_search(root: ShardingState, ev: Evaluator, axes, kinds, budget: Budget, *, seed: int = 0,
                  max_depth: int = 6) -> Result:
    rng, run = random.Random(seed), _Run(root, ev, budget)
    while not run.spent():
        s, acts = root, []
        for _ in range(rng.randint(1, max_depth)):
            cands = run.plans.candidates(s, acts, axes, kinds)
            if not cands or run.spent():
                break
            a = cands[rng.randrange(len(cands))]
            got = run.step(s, acts, a)
            if got is not None:
                _, s, acts = got
        if not candidates(root, axes, kinds):
            break
    return run.result()


def greedy(root: ShardingState, ev: Evaluator, axes, kinds, budget: Budget, **_) -> Result:
    run = _Run(root, ev, budget)
    s, acts, cur = root, [], run.best[0]
    while not run.spent():
        best = None
        for a in run.plans.candidates(s, acts, axes, kinds):
            if run.spent():
                break
            got = run.step(s, acts, a)
            if got is not None and (best is None or got[0] < best[0]):
                best = got
        if best is None or best[0] >= cur:
            break
        cur, s, acts = best
    return run.result()


def beam(root: ShardingState, ev: Evaluator, axes, kinds, budget: Budget, *, width: int = 4, **_) -> Result:
    run = _Run(root, ev, budget)
    level: list[tuple[tuple, ShardingState, list[Action]]] = [(run.best[0], root, [])]
    seen: set[frozenset] = {frozenset()}
    while level and not run.spent():
        before = run.best[0]
        nxt = []
        for _, s, acts in level:
            for a in run.plans.candidates(s, acts, axes, kinds):
                key = frozenset([*acts, a])
                if key in seen or run.spent():
                    continue
                seen.add(key)
                got = run.step(s, acts, a)
                if got is not None:
                    nxt.append(got)
        nxt.sort(key=lambda t: t[0])
        level = nxt[:width]
        if run.best[0] >= before and level and level[0][0] > before:
            break  # no state of this depth improved on the best: stop
    return run.result()


def exhaustive(root: ShardingState, ev: Evaluator, axes, kinds, budget: Budget | None = None, *,
               max_depth: int = 3, **_) -> Result:
    run = _Run(root, ev, budget or Budget())
    level: list[tuple[ShardingState, list[Action]]] = [(root, [])]
    seen: set[frozenset] = {frozenset()}
    for _ in range(max_depth):
        nxt = []
        for s, acts in level:
            for a in run.plans.candidates(s, acts, axes, kinds):
                key = frozenset([*acts, a])
                if key in seen:
                    continue
                seen.add(key)
                got = run.step(s, acts, a)
                if got is not None:
                    nxt.append((got[1], got[2]))
        level = nxt
    return run.result(0.0)  # the optimum itself (only actions that change nothing are dropped)


ALGORITHMS = {"random": random_search, "greedy": greedy, "beam": beam, "exhaustive": exhaustive}
