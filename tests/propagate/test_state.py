"""Propagation, lowering and tactics on small programs: patterns, collectives and typed errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.errors import IllegalActionError, MeshError
from partir_torch.ir import Mesh, Replicate, Tile
from partir_torch.lower import lower, summarize
from partir_torch.propagate import ShardingState
from partir_torch.tactics import Manual, ScheduleError, apply_schedule, megatron_pairs, parse_schedule


class _Unit(nn.Module):  # names carry no meaning: p1, u, v, n
    def __init__(self, d: int) -> None:
        super().__init__()
        self.n = nn.LayerNorm(d)
        self.u = nn.Linear(d, 4 * d)
        self.v = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.v(F.relu(self.u(self.n(x))))


class _Renamed(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.p1 = nn.ModuleList(_Unit(d) for _ in range(3))
        self.q = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.p1:
            x = b(x)
        return self.q(x)


def _mse(model, x, y):
    return F.mse_loss(model(x), y)


@pytest.fixture(scope="module")
def renamed():
    m = _Renamed()
    return capture(m, (torch.randn(8, 16), torch.randn(8, 1)), _mse, "adamw")


def test_megatron_pairs_come_from_structure_not_names(renamed):
    p = renamed
    state = apply_schedule(p, Mesh.parse("model=4"), "model:Megatron")
    for i in range(3):
        assert str(state.shard[p.params[f"p1.{i}.u.weight"]]) == "P('model', None)"
        assert str(state.shard[p.params[f"p1.{i}.u.bias"]]) == "P('model')"  # by propagation
        assert str(state.shard[p.params[f"p1.{i}.v.weight"]]) == "P(None, 'model')"
        assert str(state.shard[p.params[f"p1.{i}.v.bias"]]) == "P(None)"
        # optimizer states follow their parameter through the update arithmetic
        assert str(state.shard[p.value(f"opt.exp_avg[p1.{i}.u.weight]").id]) == "P('model', None)"
    assert not state.shard[p.params["q.weight"]].axes
    kinds = summarize(lower(state))
    assert set(kinds) == {"all-reduce"} and set(kinds["all-reduce"]) == {"model"}
    assert len(megatron_pairs(p, state.rules)) == 3


def test_group_action_tiles_every_layer(renamed):
    state = ShardingState(renamed, Mesh.parse("model=2"))
    state.apply(Tile("p1.*.u.weight", 0, "model"))
    assert all("model" in state.shard[renamed.params[f"p1.{i}.u.weight"]].axes for i in range(3))


def test_data_parallel_all_reduces_exactly_the_gradients():
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-mlp", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    state = apply_schedule(p, Mesh.parse("batch=8"), "batch:BatchParallel")
    coll = lower(state)
    grads = {p.grads[n] for n in p.params}
    assert {c.value for c in coll if c.kind == "all-reduce"} == grads | {p.loss}
    assert sum(c.bytes for c in coll) == p.param_bytes() + 4  # gradients + the scalar loss
    assert not state.conflicts


def test_zero_shards_optimizer_state_and_gathers_updated_params():
    model, inputs, loss_fn = models.build("tiny-mlp", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    state = apply_schedule(p, Mesh.parse("batch=4"), "batch:BatchParallel;batch:ZeRO(1)")
    w = "layers.0.fc1.weight"
    assert str(state.shard[p.value(f"opt.exp_avg[{w}]").id]) == "P('batch', None)"
    assert not state.shard[p.params[w]].axes
    kinds = summarize(lower(state))
    # gradients: all-reduce + slice fused into reduce-scatter; parameters: all-gathered after the update
    assert kinds["reduce-scatter"]["batch"] == kinds["all-gather"]["batch"] == p.param_bytes()


def test_conflicts_are_recorded_not_resolved():
    model, inputs, loss_fn = models.build("tiny-llama", device="meta")  # 2 KV heads repeated for 4 query heads
    p = capture(model, inputs, loss_fn, "sgd")
    state = apply_schedule(p, Mesh.parse("model=4"), "model:Megatron")
    assert state.conflicts and "does not divide by 4" in state.conflicts[0].why
    assert "view" in state.conflicts[0].describe(p)


def test_a_conflicted_op_runs_on_its_results_factor_and_re_tiles_the_other_operand():
    """A skip connection's `cat` of a batch-tiled tensor and a channel-tiled conv output, read batch-tiled:
    the op runs on the batch tiles and re-tiles the conv output with an all-to-all of its local block
    (what XLA does), instead of running replicated and gathering both; the step still equals unsharded."""
    from tests.rules.harness import run_plan

    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(3, 8, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(12, 2, 1)

        def forward(self, x):
            return self.c(torch.cat([self.a(x), self.b(x)], 1))

    torch.manual_seed(0)
    # x batch-tiled makes a's output and the cat batch-tiled; b's weight tiled on out-channels first makes
    # b's output channel-tiled (4 channels: no cat factor, the parts are unequal)
    state, res = run_plan(Skip(), (torch.randn(4, 3, 4, 4),), Mesh.parse("x=2"),
                          [Tile("b.weight", 0, "x"), Tile("inputs[0]", 0, "x")])
    assert res.max_rel_diff < 1e-5, res.diffs
    p = state.program
    cat = next(op for op in p.ops if op.target == "aten.cat.default")
    a_out, b_out = cat.inputs
    assert str(state.shard[b_out]) == "P(None, 'x', None, None)" and str(state.shard[a_out]).startswith("P('x'")
    assert state.op_output(cat.id, 0).dims[0] == ("x",)
    assert not [c for c in state.conflicts if c.op == cat.id]
    moved = [c for c in lower(state) if c.op == cat.id]
    assert [(c.kind, c.value, c.bytes) for c in moved] == [("all-to-all", b_out, 4 * 4 * 4 * 4 * 4 // 2)]


def test_a_conflicted_scatter_add_runs_on_its_edges_and_reduce_scatters_its_node_sums():
    """Node features tiled by nodes, messages by edges: the scatter-add's output is tiled by nodes (from the
    residual) and its source by edges, factors that conflict. It runs on the edges (its result a sum,
    reduce-scattered to the node tiles) rather than gathering the 64 messages; the step equals unsharded."""
    from tests.rules.harness import run_plan

    dst = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(0))

    class Agg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, nodes, edges):
            return nodes.index_add(0, dst, edges * self.w) + nodes

    torch.manual_seed(0)  # 3 features: the feature dim cannot tile over 2, so only the edges can settle it
    state, res = run_plan(Agg(), (torch.randn(4, 3), torch.randn(64, 3)), Mesh.parse("x=2"),
                          [Tile("inputs[0]", 0, "x"), Tile("inputs[1]", 0, "x")])
    assert res.max_rel_diff < 1e-5 and res.replica_mismatch < 1e-6, res.diffs
    p = state.program
    add = next(op for op in p.ops if op.target == "aten.index_add.default")
    out, msgs = add.outputs[0], add.inputs[2]
    assert state.op_output(add.id, 0).partial == {"x"} and str(state.shard[out]) == "P('x', None)"
    assert not [c for c in state.conflicts if c.op == add.id]
    moved = lower(state)
    assert not [c for c in moved if c.value == msgs], moved
    assert [c.kind for c in moved if c.value == out and c.op >= 0] == ["reduce-scatter"]


def test_fused_qkv_split_keeps_heads_tiled_through_an_all_to_all():
    """GPT-2's `c_attn(x).split(d, -1)` under Megatron: the column-tiled [B, T, 3d] is read in 3 chunks (one
    all-to-all of the local block, not an all-gather), q/k/v and the attention stay tiled by heads, and the
    gradients' concat writes chunks back to blocks (a second all-to-all)."""
    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    p = capture(model, inputs, loss_fn, "sgd")
    state = apply_schedule(p, Mesh.parse("model=2"), "model:Megatron")
    assert not state.conflicts
    splits = [op for op in p.ops if op.target == "aten.split.Tensor"]
    for op in splits:
        assert all(str(state.shard[v]) == "P(None, None, 'model')" for v in op.outputs if v >= 0)
    coll = lower(state)
    a2a = [c for c in coll if c.kind == "all-to-all"]
    qkv = p.values[splits[0].outputs[0]]
    block = qkv.shape[0] * qkv.shape[1] * qkv.shape[2] * 3 // 2 * qkv.dtype.itemsize
    assert len(a2a) == 2 * len(splits) and all(c.bytes == block for c in a2a)
    assert not [c for c in coll if c.kind == "all-gather"]


def test_typed_errors_show_values():
    model, inputs, loss_fn = models.build("tiny-mlp", device="meta")
    p = capture(model, inputs, loss_fn, "sgd")
    state = ShardingState(p, Mesh.parse("batch=2,model=3"))
    with pytest.raises(IllegalActionError, match=r"cannot tile layers\.0\.fc1\.weight \[32, 16\] dim 0 \(size 32\) "
                                                 r"over 'model'.*3 \(model=3\)"):
        state.apply(Tile("layers.0.fc1.weight", 0, "model"))
    with pytest.raises(MeshError, match=r"unknown mesh axis 'data'; this mesh has axes \['batch', 'model'\]"):
        state.apply(Tile("layers.0.fc1.weight", 0, "data"))
    with pytest.raises(KeyError, match=r"no value named 'layers\.0\.fc9\.weight'.*did you mean"):
        state.apply(Tile("layers.0.fc9.weight", 0, "batch"))
    state.apply(Replicate("layers.0.fc1.weight", "batch"))
    with pytest.raises(IllegalActionError, match=r"replicated on 'batch' by an earlier action"):
        state.apply(Tile("layers.0.fc1.weight", 0, "batch"))
    state.apply(Tile("layers.0.fc2.weight", 1, "batch"))
    with pytest.raises(IllegalActionError, match=r"axis 'batch' is already used on layers\.0\.fc2\.weight"):
        state.apply(Tile("layers.0.fc2.weight", 0, "batch"))


def test_schedule_text_and_errors():
    mesh = Mesh.parse("batch=2,model=4")
    ts = parse_schedule("batch:BatchParallel; model:Megatron; batch:ZeRO(3); model:ZeRO2; batch:FSDP", mesh)
    ts += parse_schedule("batch:DP", mesh)
    assert [type(t).__name__ for t in ts] == ["BatchParallel", "Megatron", "ZeRO", "ZeRO", "FSDP", "BatchParallel"]
    assert (ts[2].stage, ts[3].stage) == (3, 2)
    with pytest.raises(ScheduleError, match=r"names axis 'data'; the mesh has axes \['batch', 'model'\]"):
        parse_schedule("data:BatchParallel", mesh)
    with pytest.raises(ScheduleError, match=r"unknown tactic 'Pipeline'.*known: BatchParallel"):
        parse_schedule("batch:Pipeline", mesh)
    with pytest.raises(ScheduleError, match=r"cannot parse"):
        parse_schedule("batch BatchParallel", mesh)


def test_manual_specs(renamed):
    state = ShardingState(renamed, Mesh.parse("batch=2,model=2"))
    Manual({"p1.*.u.weight": ["model", None], "inputs[[]0[]]": ["batch", None]}).apply(state)
    assert str(state.shard[renamed.params["p1.2.u.weight"]]) == "P('model', None)"
    assert str(state.shard[renamed.inputs[0]]) == "P('batch', None)"
    with pytest.raises(ScheduleError, match=r"has 1 entries; the value has shape \[64, 16\]"):
        Manual({"p1.0.u.weight": ["model"]}).apply(state)
    with pytest.raises(ScheduleError, match=r"matches no parameter"):
        Manual({"nothing.*": [None]}).apply(state)


def test_an_illegal_group_tile_leaves_the_state_as_it_was():
    """One member of a group fenced on the axis: tiling the group is illegal and changes no member (a manual
    tactic skips it, and the plan's decisions still rebuild the state exactly)."""
    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    program = capture(model, inputs, loss_fn, "adamw")
    state = ShardingState(program, Mesh.parse("batch=2,model=4"))
    state.apply(Replicate("h.1.mlp.c_fc.weight", "model"))
    before = state.digest()
    with pytest.raises(IllegalActionError, match=r"h\.1\.mlp\.c_fc\.weight is replicated on 'model'"):
        state.apply(Tile("h.*.mlp.c_fc.weight", 0, "model"))
    assert state.digest() == before and [str(a) for a in state.actions] == ["replicate(h.1.mlp.c_fc.weight, model)"]
