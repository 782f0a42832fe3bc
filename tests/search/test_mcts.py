"""MCTS and the baselines in one harness: determinism, budgets, and the optimality gap on a small program."""

from __future__ import annotations

import pytest

from partir_torch import capture, models
from partir_torch.cost import hardware
from partir_torch.errors import PartirError
from partir_torch.ir import Mesh
from partir_torch.propagate import ShardingState
from partir_torch.search import MCTS, Budget, Evaluator
from partir_torch.search.baselines import ALGORITHMS, exhaustive

ALL = frozenset({"input", "param", "optimizer"})


@pytest.fixture(scope="module")
def mlp():
    model, inputs, loss_fn = models.build("mlp", {"batch": "512", "width": "256", "hidden": "1024", "layers": "3"})
    return capture(model, inputs, loss_fn, "adamw", fold=True)


def _ev(limit=None):
    return Evaluator(hardware("tpu-v5e"), memory_limit=limit)


def test_budget_parsing():
    assert Budget.parse("30s") == Budget(seconds=30.0) and Budget.parse("2m") == Budget(seconds=120.0)
    assert Budget.parse("500") == Budget(episodes=500) and Budget.parse(40) == Budget(episodes=40)
    with pytest.raises(PartirError, match="30s"):
        Budget.parse("soon")


def test_mcts_is_deterministic_for_a_seed_and_beats_the_start(mlp):
    root = ShardingState(mlp, Mesh.parse("batch=4,model=2"))
    runs = [MCTS(root, _ev(), ("batch", "model"), ALL, seed=3).run(Budget(episodes=60)) for _ in range(2)]
    assert [str(a) for a in runs[0].actions] == [str(a) for a in runs[1].actions]
    assert runs[0].key == runs[1].key
    start, _ = _ev().score(root)
    assert runs[0].key < start and runs[0].stats.episodes >= 40 and runs[0].stats.nodes > 10


def test_mcts_reaches_the_exhaustive_optimum_on_a_small_space(mlp):
    root = ShardingState(mlp, Mesh.parse("batch=8"))
    kinds = frozenset({"input", "param"})
    best = exhaustive(root, _ev(), ("batch",), kinds, max_depth=2)
    found = MCTS(root, _ev(), ("batch",), kinds, seed=0).run(Budget(episodes=150))
    assert found.key[0] == best.key[0] == 0
    assert found.key[2] <= best.key[2] * 1.01  # within 1 % of the optimum of all plans of <= 2 actions


@pytest.mark.parametrize("algo", ["random", "greedy", "beam"])
def test_baselines_share_the_harness(mlp, algo):
    root = ShardingState(mlp, Mesh.parse("batch=4,model=2"))
    res = ALGORITHMS[algo](root, _ev(), ("batch", "model"), ALL, Budget(episodes=30), seed=0)
    start, _ = _ev().score(root)
    assert res.key <= start and res.stats.evaluations >= 1
    # the reported state is the plan of the reported actions
    assert all(str(a) in [str(x) for x in res.state.actions] for a in res.actions)


def test_memory_limit_makes_the_search_fit(mlp):
    root = ShardingState(mlp, Mesh.parse("batch=8"))
    free = _ev().report(root).peak_memory_bytes
    limit = free * 0.5  # replicated does not fit
    res = MCTS(root, _ev(limit), ("batch",), ALL, seed=0).run(Budget(episodes=80))
    assert res.key[0] == 0, "a plan that fits exists (data parallel halves the activations)"
    assert _ev(limit).report(res.state).peak_memory_bytes <= limit
