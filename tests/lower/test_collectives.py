"""`lower.transitions`: the collectives between two shardings of one value, and what they cost."""

from __future__ import annotations

import math

import pytest
import torch

from partir_torch.cost.model import collective_time
from partir_torch.ir import Mesh, Sharding
from partir_torch.lower import Collective, reshard, transitions

MESH = Mesh.parse("data=2,fsdp=4,model=2")
SHAPE, ITEM = (64, 32), 4
FULL = 64 * 32 * 4


def _time(steps, mesh=MESH, bw=1e9):
    return sum(collective_time(Collective.make(k, a, b, 0, 0, "", ""), mesh.size(a), bw, 0.0) for k, a, b in steps)


def test_a_sum_over_several_axes_costs_one_ring_over_their_product():
    """Reduced hierarchically (the flattened sum reduce-scattered minor axis first, the part all-reduced over the
    last, gathered back: each next axis on 1/n of the bytes): k axes cost one all-reduce over n1·n2·…, not k
    all-reduces of the whole value. XLA's form (`fused`) is that one all-reduce."""
    from partir_torch.lower import fused

    src = Sharding(((), ()), frozenset({"data", "fsdp", "model"}))
    steps = transitions(src, Sharding.replicated(2), SHAPE, ITEM, MESH)
    assert steps == [("reduce-scatter", "model", FULL), ("reduce-scatter", "fsdp", FULL // 2),
                     ("all-reduce", "data", FULL // 8), ("all-gather", "fsdp", FULL // 2),
                     ("all-gather", "model", FULL)]
    assert _time(steps) == pytest.approx(2 * (16 - 1) / 16 * FULL / 1e9)
    assert fused(src, Sharding.replicated(2), steps) == {"all-reduce": FULL}
    odd = transitions(src, Sharding.replicated(1), (3,), ITEM, MESH)  # 3 elements: no flat split, one ring each
    assert odd == [("all-reduce", "model", 12), ("all-reduce", "fsdp", 12), ("all-reduce", "data", 12)]


def test_reduce_scatter_before_all_reduce():
    """A gradient summed over `data` and `fsdp` that lands tiled over `fsdp` (ZeRO on fsdp, data parallel on
    data): reduce-scatter over fsdp first, then all-reduce the quarter over data."""
    src = Sharding(((), ()), frozenset({"data", "fsdp"}))
    dst = Sharding.replicated(2).tile(0, "fsdp")
    steps = transitions(src, dst, SHAPE, ITEM, MESH)
    assert steps == [("reduce-scatter", "fsdp", FULL), ("all-reduce", "data", FULL // 4)]


def test_the_slow_axis_listed_first_moves_the_least():
    """A 2-axis gradient all-reduce on `batch=2:dcn, model=4`: the fast `model` ring carries the gradient, the
    slow `batch` ring a quarter of it."""
    mesh = Mesh.parse("batch=2,model=4")
    steps = transitions(Sharding(((),), frozenset({"batch", "model"})), Sharding.replicated(1), (1 << 20,), 4, mesh)
    assert steps == [("reduce-scatter", "model", 4 << 20), ("all-reduce", "batch", 1 << 20),
                     ("all-gather", "model", 4 << 20)]



def test_a_value_and_its_transpose_resharded_alike_are_one_collective():
    """A searched GPT-2 plan (batch and weights on one axis) gathers the fused-QKV gradient for one matmul and
    its transpose for another: XLA gathers once (`tests/backends/test_verify.py` measures it), so `lower`
    counts one; the cost model agrees to the byte."""
    from partir_torch import models
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.lower import dedup_key, end_reshards, lower, op_reshards, relayouts, summarize
    from partir_torch.search.api import Auto, Budget, SearchConfig
    from partir_torch.tactics import apply_schedule

    net, inputs, loss_fn = models.build("tiny-gpt2", {"batch": "8"}, device="meta")
    program = capture(net, inputs, loss_fn, "adamw", fold=False)
    mesh, hw = Mesh.parse("batch=2,model=4"), hardware("cpu-virtual")
    memory = int(0.4 * evaluate(apply_schedule(program, mesh, []), hw).peak_memory_bytes)
    state = apply_schedule(program, mesh, [Auto(goal="time")],
                           search=SearchConfig(hw, frozenset(), memory, 0, Budget.parse(100), "mcts", False))
    relay = relayouts(program, state.rules)
    cands = [(v, s, d) for o in state.active_ops() for v, s, d in op_reshards(state, o)] + end_reshards(state)
    merged = len({(v, d) for v, _, d in cands}) - len({dedup_key(state, relay, v, s, d) for v, s, d in cands})
    assert merged > 0, "no value is resharded together with its re-layout: the test would not test the dedup"
    plain = sum(b for v, s, d in {(v, s, d) for v, s, d in cands} for _, _, b in reshard(state, v, s, d)[0])
    counted = sum(c.bytes for c in lower(state))
    assert counted < plain  # the merged reshards are not counted twice
    assert evaluate(state, hw).comm_bytes == summarize(lower(state))


def _tiles(sh: Sharding, mesh: Mesh, shape=(8, 4)) -> list[set[int]]:
    """Each device's elements (as flat indices) under `sh`, by the simulator's own scatter."""
    from partir_torch.simulate import _Mesh

    g = torch.arange(math.prod(shape)).reshape(shape)
    return [set(t.flatten().tolist()) for t in _Mesh(mesh).scatter(g, sh)]


TILINGS = [(), ("batch",), ("model",), ("batch", "model"), ("model", "batch")]


@pytest.mark.parametrize("src", TILINGS)
@pytest.mark.parametrize("dst", TILINGS)
def test_a_reshard_is_free_exactly_when_every_device_keeps_its_new_tile(src, dst):
    """No collective iff each device's tile under `dst` lies inside its tile under `src` (the order of the
    axes on a dim matters: (batch, model) holds block 4b+m of 8, so dropping batch or putting model in front
    moves blocks between devices), checked against the simulator's layout of the tiles."""
    mesh = Mesh.parse("batch=2,model=4")
    a, b = Sharding((src, ())), Sharding((dst, ()))
    local = all(new <= old for old, new in zip(_tiles(a, mesh), _tiles(b, mesh)))
    steps = transitions(a, b, (8, 4), 4, mesh)
    assert (not steps) == local, steps
    if not local:
        assert {k for k, _, _ in steps} == {"all-gather"}


def test_gathers_off_one_dim_go_minor_axis_first_and_fuse_as_one():
    """Gathering a dim tiled (batch, model): model first (a gather over contiguous blocks), then batch; XLA
    emits the two as one all-gather over the 8 devices (`fused`: the last step's output)."""
    from partir_torch.lower import fused

    mesh = Mesh.parse("batch=2,model=4")
    both = Sharding((("batch", "model"), ()))
    steps = transitions(both, Sharding.replicated(2), (64, 32), 4, mesh)
    assert steps == [("all-gather", "model", FULL // 2), ("all-gather", "batch", FULL)]
    assert fused(both, Sharding.replicated(2), steps) == {"all-gather": FULL}
    two_dims = Sharding((("batch",), ("model",)))
    steps = transitions(two_dims, Sharding.replicated(2), (64, 32), 4, mesh)
    assert fused(two_dims, Sharding.replicated(2), steps) == {"all-gather": sum(b for _, _, b in steps)}
    summed = Sharding(((), ()), frozenset({"batch", "model"}))
    steps = transitions(summed, Sharding.replicated(2), (64, 32), 4, mesh)
    assert len(steps) == 3 and fused(summed, Sharding.replicated(2), steps) == {"all-reduce": FULL}
    batch_rows = Sharding((("batch",), ()))  # a sum reduced to a tiling over one of its axes: two collectives
    steps = transitions(summed, batch_rows, (64, 32), 4, mesh)
    assert {k for k, _, _ in steps} == {"reduce-scatter", "all-reduce"}
    assert fused(summed, batch_rows, steps) == {"reduce-scatter": FULL, "all-reduce": FULL // 2}
    # ... unless a reduction (not a dot) made the sum: one all-reduce over both axes, then a slice
    assert fused(summed, batch_rows, steps, reduction=True) == {"all-reduce": FULL}


def test_sums_made_by_a_reduction_are_told_from_a_dot_s_through_their_relayouts():
    """`made_by_reduction` follows views back to the op that made the value: a linear's weight gradient (a dot,
    then transposed) is not, its bias's (a sum, then viewed) is; inputs and pointwise results are not."""
    from partir_torch.capture import capture
    from partir_torch.lower import made_by_reduction, relayouts
    from partir_torch.propagate.analysis import Analysis

    net = torch.nn.Linear(8, 4)
    program = capture(net, (torch.randn(16, 8),), lambda m, x: m(x).square().mean(), "sgd")
    rules = Analysis.of(program, Mesh.parse("batch=2")).rules
    red = made_by_reduction(program, rules, relayouts(program, rules))
    assert not red[program.grads["weight"]] and red[program.grads["bias"]]
    assert not any(red[v] for v in program.inputs)
