"""Search: the Auto tactic (goal-guided MCTS with propagation and the cost model in the loop), baselines,
and `search()`, which returns a `ShardingPlan`."""

from partir_torch.ir.actions import ShardOptimizer
from partir_torch.search.api import Auto, InfeasibleError, SearchConfig, run_search, search
from partir_torch.search.budget import Budget, Result
from partir_torch.search.goals import GOALS, Evaluator, Score
from partir_torch.search.local import LocalSearch
from partir_torch.search.mcts import MCTS
from partir_torch.search.space import candidates, slots

__all__ = ["GOALS", "MCTS", "Auto", "Budget", "Evaluator", "InfeasibleError", "LocalSearch", "Result", "Score",
           "SearchConfig", "ShardOptimizer", "candidates", "run_search", "search", "slots"]
