"""MCTS and the baselines in one harness: determinism, budgets, and the optimality gap on a small program."""

from __future__ import annotations

import pytest

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cost import hardware
from partir_torch.errors import PartirError
from partir_torch.ir import Mesh
from partir_torch.propagate import ShardingState
from partir_torch.search import MCTS, Budget, Evaluator, candidates
from partir_torch.search.baselines import ALGORITHMS, exhaustive
from partir_torch.tactics import Context, apply_schedule

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


def test_ablated_mcts_without_pruning_or_goals_returns_a_legal_plan(mlp):
    """The ablation of benchmarks/search.py: every syntactic action offered, plain penalized reward."""
    from partir_torch.search import Auto, SearchConfig
    from partir_torch.search.space import apply_action, candidates

    axes = ("batch", "model")
    root = ShardingState(mlp, Mesh.parse("batch=4,model=2"))
    pruned, every = candidates(root, axes, ALL), candidates(root, axes, ALL, prune=False)
    assert set(pruned) < set(every)
    res = MCTS(root, Evaluator(hardware("tpu-v5e"), goals=False), axes, ALL, seed=0, prune=False).run(
        Budget(episodes=60)
    )
    # the unpruned space does offer illegal actions once something is applied; the search survives them
    assert any(not apply_action(res.state.copy(), a) for a in candidates(res.state, axes, ALL, prune=False))
    start, _ = _ev().score(root)
    assert res.actions and res.key < start
    s = root  # the reported actions are legal, in order, and make the reported plan
    for a in res.actions:
        s = s.copy()
        assert apply_action(s, a), a
    assert _ev().score(s)[0] == _ev().score(res.state)[0] == res.key

    cfg = SearchConfig(hardware("tpu-v5e"), budget=Budget(episodes=40), prune=False, goals=False)
    context = Context(cfg)
    state = apply_schedule(mlp, Mesh.parse("batch=4,model=2"), [Auto()], context=context)
    assert len(context.log) == 1 and context.log[0]["axes"] == ["batch", "model"]  # one joint tree, no per-axis goals
    assert _ev().score(state)[0] < start


def test_pruning_reaches_a_plan_at_least_as_good_with_fewer_evaluations(mlp):
    # measured on seeds 0-19: with 40 episodes the pruned search reaches its best plan (757.5 us) on every
    # seed, the unpruned one on none; the unpruned one needs ~60 episodes (~1.5x the evaluations) for it
    root = ShardingState(mlp, Mesh.parse("batch=4,model=2"))
    axes = ("batch", "model")
    strictly = 0
    for seed in range(3):
        pruned = MCTS(root, _ev(), axes, ALL, seed=seed).run(Budget(episodes=40))
        same = MCTS(root, _ev(), axes, ALL, seed=seed, prune=False).run(Budget(episodes=40))
        longer = MCTS(root, _ev(), axes, ALL, seed=seed, prune=False).run(Budget(episodes=60))
        assert pruned.key <= same.key and pruned.key <= longer.key
        assert pruned.stats.evaluations < longer.stats.evaluations
        strictly += pruned.key < same.key
    assert strictly >= 1


def test_seeds_agree_under_an_episode_budget(mlp):
    """Issue [search]: 5 seeds within 2 % of the best; here the default (both orders, then the refinement from
    both plans) on a small MLP, with an episode budget (deterministic)."""
    from partir_torch.search import Auto, SearchConfig

    times = []
    for seed in range(5):
        cfg = SearchConfig(hardware("tpu-v5e"), seed=seed, budget=Budget(episodes=100))
        context = Context(cfg)
        state = apply_schedule(mlp, Mesh.parse("batch=4,model=2"), [Auto()], context=context)
        times.append(_ev().report(state).step_time_s)
        chosen = [e["mode"] for e in context.log if e["chosen"]]  # the refinement, or the better run if it did not help
        assert chosen == ["refine"] or set(chosen) in ({"incremental"}, {"joint"}), chosen
    assert max(times) <= min(times) * 1.02, times


def test_refinement_places_and_inserts_before_a_zero_move_and_swaps_its_stage(mlp):
    """The ZeRO move fences the parameters on its axis, so a tile of one of them is legal only before it: an
    added parameter tile takes its place first (`space.rank`), a late one is inserted before the ZeRO move, and
    an action is replaced by another on the same slot."""
    from partir_torch.ir.actions import Tile
    from partir_torch.search.space import ShardOptimizer, TileLate

    root = ShardingState(mlp, Mesh.parse("batch=8"))
    m = MCTS(root, _ev(), ("batch",), ALL, seed=0)
    acts = [Tile("inputs[0]", 0, "batch"), ShardOptimizer("*", -1, "batch", 1)]
    state = m.plans.replay(acts)
    moves = [(g, t) for g, t, _ in m.local._neighbours(state, acts, m._candidates(state, acts), lambda: False)]
    assert (1, [acts[0], ShardOptimizer("*", -1, "batch", 3)]) in moves
    placed = [t[0] for g, t in moves if g == 0 and len(t) == 3 and t[1:] == acts]
    assert placed and all(isinstance(a, Tile) and a.target != "inputs[0]" for a in placed)
    inserted = [t[1] for g, t in moves if g == 2 and len(t) == 3 and t[0] == acts[0] and t[2] == acts[1]]
    assert any(isinstance(a, TileLate) for a in inserted)
    assert all(a not in candidates(state, ("batch",), ALL) for a in inserted)  # illegal after the ZeRO move
    start, _ = _ev().score(state)
    m.local.refine(None, 400, starts=[acts])
    assert m.best[0] <= start


def test_baselines_answer_with_the_same_simplicity_rule():
    """S7 in small: data parallelism is within 0.5 % of the best; random search keeps nothing more either, and
    the rule is applied in passes (an action may be worth keeping only beside one dropped later)."""
    from partir_torch.ir.actions import Tile
    from partir_torch.search.mcts import simplify
    from partir_torch.search.space import ShardOptimizer, replay

    model, inputs, loss_fn = models.build("mlp", {"batch": "65536", "width": "64", "hidden": "256"})
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    root = ShardingState(program, Mesh.parse("batch=8"))
    ev = Evaluator(hardware("cpu-virtual"))
    res = ALGORITHMS["random"](root, ev, ("batch",), ALL, Budget(episodes=60), seed=0)
    assert [str(a) for a in res.actions] in (["tile(inputs[0], 0, batch)"], ["tile(inputs[1], 0, batch)"])

    # found by random search on S7 (seed 3, 10 s): one pass newest first kept the fc1 move (0.14 % faster than DP)
    acts = [Tile("inputs[0]", 0, "batch"), ShardOptimizer("head.bias", 0, "batch", 3),
            ShardOptimizer("layers.*.fc1.weight", 0, "batch", 3), ShardOptimizer("*", -1, "batch", 3)]
    state = replay(root, acts)
    key, _ = ev.score(state)
    _, _, kept = simplify(lambda a: replay(root, a), ev, (key, state, acts), key, 0.005)
    assert kept == acts[:1]


def test_wide_nodes_are_widened_progressively_largest_decision_first(mlp):
    """A node with more candidates than `widen_above` keeps at most `widen` * sqrt(n + 1) children, and
    expands them largest decision (bytes it tiles) first; below the threshold nothing changes."""
    from partir_torch.search.space import decided_bytes

    root = ShardingState(mlp, Mesh.parse("batch=4,model=2"))
    n_cands = len(candidates(root, ("batch", "model"), ALL))
    m = MCTS(root, _ev(), ("batch", "model"), ALL, seed=1, widen=1.0, widen_above=0)
    m.run(Budget(episodes=40), refine=0.0)
    node = m.root
    assert len(node.children) <= 1.0 * (node.n + 1) ** 0.5 + 1 < n_cands
    sizes = [decided_bytes(root, a) for a, _ in node.children]
    assert sizes[0] == max(decided_bytes(root, a) for a in candidates(root, ("batch", "model"), ALL))
    assert sizes == sorted(sizes, reverse=True)
    narrow = MCTS(root, _ev(), ("batch", "model"), ALL, seed=1, widen=1.0, widen_above=n_cands)
    narrow.run(Budget(episodes=40), refine=0.0)
    assert len(narrow.root.children) > len(node.children)


def test_selection_visits_a_node_once_per_episode_when_transpositions_close_a_cycle(mlp):
    """Adding a layer's tile before the batch split can decide less than the plan before it, so a transposition
    can link a node back to one that leads to it through another route; selection must still end (before the
    guard, S3's incremental search looped there for good)."""
    root = ShardingState(mlp, Mesh.parse("batch=8"))
    m = MCTS(root, _ev(), ("batch",), ALL, seed=0)
    m.run(Budget(episodes=6), refine=0)
    a, x = m.root.children[0]
    x.children, x.untried = [(a, m.root)], []  # a cycle: root -> x -> root
    m.root.children, m.root.untried = [(a, x)], []
    before = m.stats.episodes
    m.episode()  # selects root -> x, then x's only child is on the path: it stops there and scores x
    assert m.stats.episodes == before + 1 and x.n >= 2


def test_parameter_tiles_that_propagate_alike_are_two_plans_and_the_refinement_walks_between_them(mlp):
    """A Megatron pair: fc1's weight tiled on its output dim, or fc2's on its input dim, propagates to the same
    shardings. For the cost model that is one plan, not for what may follow (an action added later is placed
    after the parameter tiles): the tree merges them (one transposition), the refinement tells them apart and
    its plateau walk (`_twins`) goes from one to the other."""
    from partir_torch.ir.actions import Tile

    root = ShardingState(mlp, Mesh.parse("model=8"))
    m = MCTS(root, _ev(), ("model",), ALL, seed=0)
    a, b = [Tile("layers.*.fc1.weight", 0, "model")], [Tile("layers.*.fc2.weight", 1, "model")]
    sa, sb = m.plans.replay(a), m.plans.replay(b)
    assert all(sa.shard[v] == sb.shard[v] and sa.locked[v] == sb.locked[v] for v in m.local._decided)
    assert m._fingerprint(sa) == m._fingerprint(sb)
    assert m._plan_print(sa, a) != m._plan_print(sb, b)
    assert m._plan_print(sa, a) == m._plan_print(m.plans.replay(a), list(a))
    key, _ = m.ev.score(sa, frozenset(a))
    twins = {tuple(t): k for k, _, t in m.local._twins(key, sa, a, lambda: False)}
    assert tuple(b) in twins and all(k <= key for k in twins.values())
    assert not any(t[0].target == a[0].target for t in twins)  # another slot's tile, not another dim of the same
