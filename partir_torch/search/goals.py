"""Goals: what the search optimizes on an axis, and the evaluator that scores a state with the cost model.

    time           (default) fit memory, then minimize estimated step time
    communication  fit memory, then minimize communication time (step time breaks ties): an axis only
                   communicates when that is needed to fit
    zero           shard only parameters and optimizer state on the axis (ZeRO-like moves only), fit
                   memory, then minimize step time
A plan that does not fit always ranks below one that does; among infeasible plans, less memory is better.
The MCTS reward maps that order into numbers: a feasible plan scores 1 + t_ref / t (t its objective, t_ref
the start state's), an infeasible one limit / peak, below 1.

`goals=False` is the ablation of `benchmarks/search.py`: the reward is the plain step time with a memory
penalty, t_ref / (t * max(1, peak / limit)), with no step between plans that fit and plans that do not
(the answer is still the best plan in the order above: the search must return a plan that fits if it saw one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from partir_torch.cost.hardware import Hardware
from partir_torch.cost.model import CostReport, evaluate
from partir_torch.errors import PartirError
from partir_torch.propagate import ShardingState

GOALS = ("time", "communication", "zero")
GOAL_ACTIONS = {"time": frozenset({"input", "param", "optimizer"}),  # the action kinds each goal may take
                "communication": frozenset({"input", "param", "optimizer"}),
                "zero": frozenset({"optimizer"})}


class Score(NamedTuple):
    """A plan's score, smaller is better in tuple order: plans that fit first, then less memory among those
    that do not, then the goal's objective (seconds)."""

    infeasible: int  # 0 fits, 1 does not (2: `WORST`, below every plan)
    memory: float  # peak bytes per device when it does not fit, else 0
    objective: float

    def beats(self, other: Score, margin: float) -> bool:
        """Better than `other` by more than `margin` of its objective, or fits where it does not, or (neither
        fitting) needs less memory: what a local search step must achieve to be taken."""
        if self.infeasible != other.infeasible:
            return self.infeasible < other.infeasible
        if self.infeasible:
            return self.memory < other.memory
        return self.objective < other.objective * (1 - margin)

    def keeps(self, plan: Score, ref: Score, margin: float) -> bool:
        """A simplification of `plan` scoring this is kept: as feasible, no more memory, and an objective no
        worse than the plan's or within `margin` of `ref` (the best found)."""
        return (self.infeasible == plan.infeasible and self.memory <= plan.memory
                and self.objective <= max(plan.objective, ref.objective * (1 + margin)))


WORST = Score(2, 0.0, 0.0)


def check_goal(goal: str) -> str:
    if goal not in GOALS:
        raise PartirError(f"unknown search goal {goal!r}; goals: {', '.join(GOALS)}")
    return goal


@dataclass
class Evaluator:
    """Costs states with the cost model, caches scores by state, and keeps timing statistics."""

    hw: Hardware
    dcn_axes: frozenset[str] = frozenset()
    memory_limit: float | None = None
    goal: str = "time"
    goals: bool = True  # False: the plain penalized step-time reward (ablation)
    evaluations: int = 0
    cost_time_s: float = 0.0
    cache: dict = field(default_factory=dict)

    @property
    def limit(self) -> float:
        return self.hw.memory if self.memory_limit is None else self.memory_limit

    def report(self, state: ShardingState) -> CostReport:
        t0 = time.perf_counter()
        r = evaluate(state, self.hw, dcn_axes=self.dcn_axes, memory_limit=self.memory_limit)
        self.cost_time_s += time.perf_counter() - t0
        self.evaluations += 1
        return r

    def key(self, r: CostReport) -> Score:
        """The report's `Score` under this goal."""
        if not r.feasible:
            return Score(1, float(r.peak_memory_bytes), r.step_time_s)
        obj = r.comm_time_s + 1e-3 * r.step_time_s if self.goal == "communication" else r.step_time_s
        return Score(0, 0.0, obj)

    def score(self, state: ShardingState, cache_key=None) -> tuple[Score, CostReport | None]:
        if cache_key is not None and cache_key in self.cache:
            return self.cache[cache_key], None
        r = self.report(state)
        k = self.key(r)
        if cache_key is not None:
            self.cache[cache_key] = k
        return k, r

    def reward(self, key: Score, ref: Score) -> float:
        """The MCTS reward of the module docstring (`ref`: the start state's score)."""
        if not self.goals:  # the objective is the step time (goal "time")
            if key.objective <= 0:
                return 1.0
            return ref.objective / (key.objective * (max(1.0, key.memory / self.limit) if key.infeasible else 1.0))
        if key.infeasible:
            return min(self.limit / key.memory, 0.999)
        return 1.0 + (ref.objective / key.objective if key.objective > 0 else 1.0)
