"""The action space: slots from roles and groups, pruning by propagation, and ShardOptimizer proven by the
simulator (a searched plan must compute what the unsharded step computes)."""

from __future__ import annotations

import random

import pytest
import torch

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.ir import Mesh, Tile
from partir_torch.propagate import ShardingState
from partir_torch.search.space import Plans, ShardOptimizer, TileLate, apply_action, candidates, replay, slots
from partir_torch.simulate import simulate
from partir_torch.tactics import apply_schedule

ALL = frozenset({"input", "param", "optimizer"})


def _llama():
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-llama", device="cpu")
    return model, inputs, capture(model, inputs, loss_fn, "adamw")


def test_slots_are_groups_inputs_and_optimizer_and_candidates_are_pruned():
    _, _, p = _llama()
    s = slots(p)
    kinds = {k.kind for k in s}
    assert kinds == {"input", "param", "optimizer"}
    assert any(k.target.count("*") for k in s)  # one slot per group of repeated layers
    state = ShardingState(p, Mesh.parse("batch=2,model=4"))
    before = candidates(state, ("batch",), ALL)
    assert Tile("inputs[0]", 0, "batch") in before
    state.apply(Tile("inputs[0]", 0, "batch"))
    after = candidates(state, ("batch",), ALL)
    # implied by propagation (the labels follow the tokens) or now illegal: no longer offered
    assert Tile("inputs[0]", 0, "batch") not in after and Tile("inputs[1]", 0, "batch") not in after
    # a dim that the axis does not divide is never offered
    cands = candidates(state, ("model",), ALL)
    assert ShardOptimizer("*", -1, "model", 1) in cands  # the whole-model ZeRO move
    for a in cands:
        if a.target == "*":
            continue
        v = p.values[state.resolve(a.target)[0]]
        assert v.shape[a.dim] % 4 == 0


def test_shard_optimizer_matches_zero_tactic_and_simulates():
    model, inputs, p = _llama()
    mesh = Mesh.parse("batch=2,model=2")
    zero = apply_schedule(p, mesh, "batch:DP;batch:ZeRO(1)")
    state = apply_schedule(p, mesh, "batch:DP")
    for s in slots(p):
        if s.kind == "optimizer":
            for d in range(len(p.values[s.value].shape)):
                if apply_action(state.copy(), ShardOptimizer(s.target, d, "batch", 1)):
                    assert apply_action(state, ShardOptimizer(s.target, d, "batch", 1))
                    break
    sharded = [n for n, st in p.opt_states.items() if state.shard[st["exp_avg"]].axes]
    assert sharded and all(not state.shard[p.params[n]].axes - {"model"} for n in sharded)  # stage 1: params kept
    by_zero = {n for n, st in p.opt_states.items() if zero.shard[st["exp_avg"]].axes}
    assert set(sharded) <= by_zero  # the per-group move shards what the ZeRO tactic shards
    for n in sharded:  # and in the same way where both picked the first divisible dim
        st = p.opt_states[n]["exp_avg"]
        assert state.shard[st].axes == zero.shard[st].axes
    params = {n: t.detach() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    states = {n: {"exp_avg": torch.randn(t.shape, generator=g) * 0.01,
                  "exp_avg_sq": torch.rand(t.shape, generator=g) * 0.01,
                  "step": torch.tensor(3.0)} for n, t in model.named_parameters()}
    res = simulate(p, state, params, dict(model.named_buffers()), inputs, states)
    assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5


def test_random_searched_plans_simulate_exactly():
    """Any sequence of candidate actions (tiles and ZeRO moves, both axes) is a correct program."""
    model, inputs, p = _llama()
    mesh = Mesh.parse("batch=2,model=2")
    params = {n: t.detach() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    states = {n: {"exp_avg": torch.randn(t.shape, generator=g) * 0.01,
                  "exp_avg_sq": torch.rand(t.shape, generator=g) * 0.01,
                  "step": torch.tensor(3.0)} for n, t in model.named_parameters()}
    for seed in range(3):
        rng = random.Random(seed)
        state = ShardingState(p, mesh)
        applied = 0
        for _ in range(5):
            cands = candidates(state, mesh.names, ALL)
            nxt = state.copy()
            if apply_action(nxt, rng.choice(cands)):
                state, applied = nxt, applied + 1
        # pruned candidates are legal: every draw applied, so the check compares a sharded program
        assert applied == 5 and any(sh.axes for sh in state.shard), seed
        res = simulate(p, state, params, dict(model.named_buffers()), inputs, states)
        assert res.max_abs_diff <= 1e-5, (seed, [str(a) for a in state.actions])


def test_plans_place_a_layer_tile_before_the_batch_split_and_simulate():
    """Canonical order (`space.rank`): a parameter tile added to a plan that splits the batch takes effect
    first (that layer model-parallel on the axis, the rest batch-parallel around it), even after a ZeRO move
    that fences the parameters; the late tile is an action of its own with another plan; both compute what the
    unsharded step computes."""
    model, inputs, p = _llama()
    mesh = Mesh.parse("batch=2,model=2")
    params = {n: t.detach() for n, t in model.named_parameters()}
    states = {n: {"exp_avg": torch.full(t.shape, 0.01), "exp_avg_sq": torch.full(t.shape, 0.02),
                  "step": torch.tensor(3.0)} for n, t in model.named_parameters()}
    root = ShardingState(p, mesh)
    plans = Plans(root)
    split, zero = Tile("inputs[0]", 0, "batch"), ShardOptimizer("*", -1, "batch", 1)
    s1, a1 = plans.extend(root, [], split)
    s2, a2 = plans.extend(s1, a1, zero)
    layer = next(a for a in plans.candidates(s2, a2, ("batch",), ALL)
                 if isinstance(a, Tile) and "*" in a.target and len(p.values[root.resolve(a.target)[0]].shape) == 2)
    assert layer not in candidates(s2, ("batch",), ALL)  # fenced by the ZeRO move: legal only at its place
    s3, a3 = plans.extend(s2, a2, layer)
    assert a3 == [layer, split, zero]
    assert s3.shard == replay(root, a3).shard
    w = root.resolve(layer.target)[0]
    assert "batch" in s3.shard[w].dims[layer.dim]
    late = TileLate(layer.target, layer.dim, layer.axis)
    assert late in plans.candidates(s1, a1, ("batch",), ALL) and late not in plans.candidates(root, [], ("batch",), ALL)
    s4, a4 = plans.extend(s1, a1, late)
    assert a4 == [split, late] and s4.shard != plans.extend(s1, a1, layer)[0].shard
    for s in (s3, s4):
        res = simulate(p, s, params, dict(model.named_buffers()), inputs, states)
        assert res.max_abs_diff <= 1e-5, [str(a) for a in s.actions]
    # several actions at once, one replay: one that is illegal at its place (the axis twice on a value) is left out
    other = Tile(layer.target, 1 - layer.dim, "batch")
    s5, a5 = plans.extend_many(s2, a2, [layer, other])
    assert a5 == a3 and s5.shard == s3.shard


def test_copy_is_independent():
    _, _, p = _llama()
    a = ShardingState(p, Mesh.parse("batch=2,model=2"))
    b = a.copy()
    b.apply(Tile("inputs[0]", 0, "batch"))
    assert not any(sh.axes for sh in a.shard) and not any(a.assign)
    assert any(sh.axes for sh in b.shard)


def test_whole_model_zero_is_not_offered_again_once_nothing_divides():
    # the U-Net's conv_out.bias (3 channels) never divides by 4: its state stays replicated after the move,
    # which once kept the move on offer; applied again it is illegal (and MCTS walked a self-loop forever)
    model, inputs, loss_fn = models.build("tiny-unet", {"batch": "8"})
    p = capture(model, inputs, loss_fn, "adamw", fold=True)
    for stage in (1, 3):
        state = ShardingState(p, Mesh.parse("batch=4,model=2"))
        assert apply_action(state, ShardOptimizer("*", -1, "batch", stage))
        left = [n for n, st in p.opt_states.items()
                if any(k not in p.shared_states and not state.shard[v].axes for k, v in st.items())]
        assert left  # some optimizer state is still replicated on batch ...
        assert not apply_action(state.copy(), ShardOptimizer("*", -1, "batch", stage))  # ... but cannot be tiled
        offered = candidates(state, ("batch", "model"), ALL)
        assert ShardOptimizer("*", -1, "batch", stage) not in offered
        assert all(apply_action(state.copy(), a) for a in offered)  # every pruned candidate is legal


def test_decided_bytes_ranks_inputs_then_whole_model_zero_then_groups_by_size():
    """The prior of wide nodes: an input's tile decides the activations computed from it, so it ranks first;
    then the whole-model ZeRO move (every optimizer state); a group counts all its members."""
    from partir_torch.ir.program import Role
    from partir_torch.search.space import decided_bytes

    _, _, p = _llama()
    state = ShardingState(p, Mesh.parse("batch=2,model=4"))
    cands = candidates(state, ("batch",), ALL)
    by = {a: decided_bytes(state, a) for a in cands}
    inputs = [a for a in cands if isinstance(a, Tile) and a.target.startswith("inputs[")]
    params = [a for a in cands if isinstance(a, Tile) and not a.target.startswith("inputs[")]
    acts = sum(v.nbytes for v in p.values if v.role is Role.ACTIVATION)
    assert inputs and params and min(by[a] for a in inputs) > acts > 0
    assert min(by[a] for a in inputs) > by[ShardOptimizer("*", -1, "batch", 1)] > max(by[a] for a in params)
    group = next(a for a in params if "*" in a.target)
    assert by[group] == sum(p.values[v].nbytes for v in state.resolve(group.target)) > p.values[
        state.resolve(group.target)[0]].nbytes
    assert by[ShardOptimizer("*", -1, "batch", 3)] > by[ShardOptimizer("*", -1, "batch", 1)]


def test_an_action_printed_in_a_plans_log_parses_back_to_itself():
    from partir_torch.search.space import parse_action

    for a in (Tile("h.*.attn.c_attn.weight", 1, "model"), TileLate("inputs[0]", 0, "batch"),
              ShardOptimizer("*", -1, "model", 3), ShardOptimizer("wte.weight", 0, "batch", 1)):
        assert parse_action(str(a)) == a
    with pytest.raises(ValueError, match="not a search action"):
        parse_action("replicate(x, batch)")
