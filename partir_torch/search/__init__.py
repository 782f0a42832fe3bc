"""Search: the Auto tactic (goal-guided MCTS with propagation and the cost model in the loop), baselines,
and `search()`, which returns a `ShardingPlan`."""

from partir_torch.search.api import Auto, InfeasibleError, SearchConfig, run_search, search
from partir_torch.search.goals import GOALS, Evaluator
from partir_torch.search.mcts import MCTS, Budget, Result
from partir_torch.search.space import ShardOptimizer, candidates, slots

__all__ = ["GOALS", "MCTS", "Auto", "Budget", "Evaluator", "InfeasibleError", "Result", "SearchConfig",
           "ShardOptimizer", "candidates", "run_search", "search", "slots"]
