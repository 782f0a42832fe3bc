"""`lower.transitions`: the collectives between two shardings of one value, and what they cost."""

from __future__ import annotations

import pytest

from partir_torch.cost.model import collective_time
from partir_torch.ir import Mesh, Sharding
from partir_torch.lower import Collective, transitions

MESH = Mesh.parse("data=2,fsdp=4,model=2")
SHAPE, ITEM = (64, 32), 4
FULL = 64 * 32 * 4


def _time(steps, mesh=MESH, bw=1e9):
    return sum(collective_time(Collective.make(k, a, b, 0, 0, "", ""), mesh.size(a), bw, 0.0) for k, a, b in steps)


def test_a_sum_over_several_axes_costs_one_ring_over_their_product():
    """Reduced hierarchically (minor axis first, each next one on 1/n of the bytes): k axes cost one all-reduce
    over n1·n2·…, not k all-reduces of the whole value."""
    src = Sharding(((), ()), frozenset({"data", "fsdp", "model"}))
    steps = transitions(src, Sharding.replicated(2), SHAPE, ITEM, MESH)
    assert steps == [("all-reduce", "model", FULL), ("all-reduce", "fsdp", FULL // 2),
                     ("all-reduce", "data", FULL // 8)]
    assert _time(steps) == pytest.approx(2 * (16 - 1) / 16 * FULL / 1e9)


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
    assert steps == [("all-reduce", "model", 4 << 20), ("all-reduce", "batch", 1 << 20)]
