"""Every rule family, proven on random shardings by the per-device simulator (hypothesis)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import needs
from tests.rules.harness import check

SETTINGS = settings(max_examples=needs.examples(12), deadline=None, suppress_health_check=list(HealthCheck))


class Lambda(nn.Module):
    def __init__(self, fn, **params) -> None:
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            self.register_parameter(k, nn.Parameter(v))

    def forward(self, *xs):
        return self.fn(self, *xs)


def r(*shape):
    return torch.randn(*shape)


@SETTINGS
@given(st.data())
def test_pointwise(data):
    m = Lambda(lambda s, x, y: (torch.where(x > 0, F.gelu(x * s.w + y), torch.sigmoid(y) - x.exp().sqrt())
                                / (2 + s.b * s.b)),
               w=r(8, 4), b=r(4))
    check(m, (r(8, 4), r(1, 4)), data)


@SETTINGS
@given(st.data())
def test_matrix(data):
    m = Lambda(lambda s, x, y: torch.bmm(F.linear(x, s.w, s.b), y), w=r(8, 4), b=r(8))
    check(m, (r(4, 8, 4), r(4, 8, 4)), data)


@SETTINGS
@given(st.data())
def test_reduction(data):
    m = Lambda(lambda s, x: (x * s.w).sum(1, keepdim=True) + x.mean(-1, keepdim=True) + x.cumsum(2), w=r(4, 8))
    check(m, (r(8, 4, 8),), data)


@SETTINGS
@given(st.data())
def test_view(data):
    def f(s, x):
        y = (x @ s.w).view(4, 8, 2, 4).transpose(1, 2).permute(0, 2, 1, 3).reshape(4, 8, 8)
        z = torch.cat([y, y[:, :, :4].unsqueeze(0).squeeze(0).expand(4, 8, 4)], dim=2)
        a, b = z.split(6, dim=2)
        return a.sum(-1) + b[:, :, 0] + z.select(2, 1) + z[:, :, :].sum(-1)
    check(Lambda(f, w=r(8, 8)), (r(4, 8, 8),), data)


@SETTINGS
@given(st.data())
def test_normalization(data):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.gn = nn.GroupNorm(2, 4)

        def forward(self, x, y):
            return (F.softmax(self.ln(x), -1) + F.log_softmax(x, 1)
                    + self.gn(y).mean((2, 3)).sum(-1, keepdim=True).unsqueeze(-1))
    check(M(), (r(4, 4, 8), r(4, 4, 2, 2)), data)


@SETTINGS
@given(st.data())
def test_attention(data):
    m = Lambda(lambda s, q, k: F.scaled_dot_product_attention(q * s.w, k, k, is_causal=True), w=r(8))
    check(m, (r(2, 4, 8, 8), r(2, 4, 8, 8)), data)


@SETTINGS
@given(st.data())
def test_indexing(data):
    idx = torch.tensor([0, 3, 1, 1, 2, 0, 3, 2])

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 8)

        def forward(self, x):
            e = self.emb(idx)  # [8, 8]
            g = x.index_select(0, idx)  # [8, 8]
            s = torch.zeros(4, 8).index_add(0, idx, g * e)
            up = F.interpolate(s.view(1, 4, 2, 4), scale_factor=2, mode="nearest")
            return s.sum() + up.sum(1) .sum() + e.sum(0)
    check(M(), (r(4, 8),), data)


@SETTINGS
@given(st.data())
def test_conv(data):
    m = nn.Conv2d(4, 8, 3, padding=1)
    check(m, (r(4, 4, 6, 6),), data)


@SETTINGS
@given(st.data())
def test_depthwise_and_grouped_conv(data):
    """A depthwise convolution's channels tile (its groups are its channels), a grouped one's stay whole."""
    m = nn.Sequential(nn.Conv2d(4, 8, 1), nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, padding=1, groups=2),
                      nn.ConvTranspose2d(8, 8, 2, stride=2, groups=8))
    check(m, (r(4, 4, 6, 6),), data)


@SETTINGS
@given(st.data())
def test_loss(data):
    target = torch.tensor([0, 3, 1, 2, 2, 1, 0, 3])

    def f(s, x, y):
        return F.cross_entropy(x @ s.w, target) + F.mse_loss(x, y)
    check(Lambda(f, w=r(8, 4)), (r(8, 8), r(8, 8)), data)


@SETTINGS
@given(st.data())
def test_random_dropout_mask_is_the_unsharded_one(data):
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    m.train()
    check(m, (r(8, 8),), data)


@SETTINGS
@given(st.data())
def test_batchnorm_training(data):
    m = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
    m(r(4, 4, 2, 2))  # materialize the lazy layer
    m.train()
    check(m, (r(4, 4, 2, 2),), data)


@SETTINGS
@given(st.data())
def test_instance_norm_with_running_statistics(data):
    """`instance_norm` passes batch norm its buffers repeated per instance; the decomposition's update of that
    intermediate (a `copy_` below functionalization) is its value from then on (`capture.convert`)."""
    m = nn.Sequential(nn.Conv2d(4, 4, 1), nn.InstanceNorm2d(4, affine=True, track_running_stats=True), nn.ReLU(),
                      nn.Flatten(), nn.LazyLinear(4))
    m(r(4, 4, 2, 2))
    m.train()
    check(m, (r(4, 4, 2, 2),), data)


@settings(SETTINGS, max_examples=needs.examples(6))  # one capture of two recurrent layers is the slow part
@given(st.data())
def test_rnn(data):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 8, batch_first=True)
            # torch_xla patches nn.GRU with its scan-based GRU when it is imported (conftest starts it)
            self.gru = getattr(nn.GRU, "_orig", nn.GRU)(8, 4, batch_first=True)

        def forward(self, x):
            return self.gru(self.lstm(x)[0])[0]
    check(M(), (r(4, 3, 4),), data)


@SETTINGS
@given(st.data())
def test_scan_sort_flip(data):
    def f(s, x):
        h = x @ s.w
        v, _ = torch.sort(h, dim=1)
        t, _ = torch.topk(h, 2, dim=0)
        return v + h.cumsum(1) + h.cumprod(0) + h.flip(1) + h.argsort(1).float() + t.sum(0)
    check(Lambda(f, w=r(8, 8)), (r(4, 8),), data)


@SETTINGS
@given(st.data())
def test_non_sum_reductions(data):
    def f(s, x):
        h = x * s.w
        return (h.amax(1) + h.prod(1) + h.max(1).values + h.logsumexp(1) + h.var(1) + h.argmax(1).float()
                + h.gt(0).any(1).float() + h.std(0).sum())
    check(Lambda(f, w=r(4, 6)), (r(4, 6),), data)


@SETTINGS
@given(st.data())
def test_gather_scatter_and_advanced_indexing(data):
    idx = torch.tensor([0, 3, 1, 1])
    perm = torch.tensor([[1, 0, 2, 3, 5, 4, 7, 6]] * 4)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(r(8, 8))
            self.bag = nn.EmbeddingBag(6, 8, mode="sum")

        def forward(self, x):
            h = x @ self.w  # [4, 8]
            g = torch.gather(h, 1, perm)
            sa = torch.zeros_like(h).scatter_add(1, perm, h * 2)
            a = h[:, idx]  # advanced indexing: index_put in the backward
            b = h[idx]
            e = self.bag(torch.tensor([[0, 2], [1, 5], [3, 3], [4, 0]]))
            return g + sa + e + b + a.sum(1, keepdim=True) + torch.zeros(4, 8).index_add(0, idx, h)
    check(M(), (r(4, 8),), data)


@SETTINGS
@given(st.data())
def test_a_table_read_by_an_index_of_more_dims(data):
    """A 1-D table read by a 2-D index (a relative-position bias, `bias[index]`): the backward's index_put
    writes through an index with more dims than the table it writes into."""
    pos = torch.arange(4)
    rel = pos[:, None] - pos[None, :] + 3  # [4, 4], into a table of 7

    def f(s, x):
        h = x @ s.w  # [4, 8]
        return h @ h.transpose(0, 1) + s.t[rel]
    check(Lambda(f, w=r(8, 8), t=r(7)), (r(4, 8),), data)


@SETTINGS
@given(st.data())
def test_integer_and_boolean_mask_ops(data):
    def f(s, x, ids):
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand_as(ids)  # position ids
        keep = torch.logical_and(ids.ne(0), torch.fmod(pos, 3) != 1) | torch.signbit(x)
        odd = torch.remainder(ids, 2).bool() ^ (ids.bitwise_and(4) > 0)
        h = torch.where(keep, x * s.w, 0.0) + torch.where(odd, 1.0, x)
        return h.masked_fill(~keep, -1.0) + torch.fmod(h, 0.7) + torch.tril(h.view(4, 2, 4)).view(4, 8)
    check(Lambda(f, w=r(8)), (r(4, 8), torch.randint(0, 6, (4, 8))), data)


@SETTINGS
@given(st.data())
def test_stack_unbind_pad_repeat_and_writes(data):
    def f(s, x):
        h = x @ s.w  # [4, 8]
        st_ = torch.stack([h, h * 2], dim=1)  # [4, 2, 8]
        a, b = st_.unbind(1)
        p = F.pad(h, (1, 1))[:, 1:-1]
        y = h.clone()
        y[:, 0] = a[:, 1]  # select_scatter
        y[:, 2:4] = b[:, :2]  # slice_scatter
        z = h.masked_scatter(h > 0, b * 3)
        return a + p + y + z + h.repeat(1, 2)[:, :8]
    check(Lambda(f, w=r(8, 8)), (r(4, 8),), data)


@SETTINGS
@given(st.data())
def test_resampling_and_adaptive_pooling(data):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            h = self.conv(x)
            up = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
            return F.adaptive_avg_pool2d(up, 1).flatten(1) + F.adaptive_max_pool2d(h, 2).sum((2, 3))
    check(M(), (r(4, 4, 4, 4),), data)


@SETTINGS
@given(st.data())
def test_batchnorm_eval(data):
    m = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(4))
    m(r(4, 4, 2, 2))
    m[1].running_mean.normal_()
    m[1].running_var.uniform_(0.5, 2.0)
    m.eval()
    check(m, (r(4, 4, 2, 2),), data)


def test_embedding_with_its_rows_tiled_is_a_masked_lookup_summed_over_the_row_axis():
    """Vocab-parallel embedding: the table stays tiled on its rows, each device looks up the rows it holds
    and the [.., D] result is all-reduced (not the table gathered), with the same values as unsharded."""
    from partir_torch.ir import Mesh, Tile
    from tests.rules.harness import run_plan

    idx = torch.tensor([[0, 7, 3, 3], [5, 1, 6, 2]])
    emb = nn.Embedding(8, 6)
    m = Lambda(lambda self, x: emb(idx) * x)
    m.emb = emb
    table = "emb.weight"
    state, res = run_plan(m, (r(2, 4, 6),), Mesh.parse("x=4,y=2"), [Tile(table, 0, "x"), Tile("inputs[0]", 0, "y")])
    assert res.max_rel_diff < 1e-5 and res.replica_mismatch < 1e-6, res.diffs
    prog = state.program
    look = next(o for o in prog.ops if o.target == "aten.embedding.default")
    out = next(v for v in look.outputs if v >= 0)
    assert state.op_output(look.id, 0).partial == {"x"}
    gathered = [c for c in res.collectives if c.kind == "all-gather" and prog.values[c.value].name == table]
    assert not gathered, gathered
    assert any(c.kind in ("all-reduce", "reduce-scatter") and c.value == out and c.axis == "x" for c in res.collectives)
    # the backward: each device adds the tokens of its rows, so the table's gradient is summed over the
    # tokens' axis in row tiles (8 / 4 rows of 6 floats), never as the whole [8, 6] table
    back = next(o for o in prog.ops if o.target == "aten.embedding_dense_backward.default")
    assert state.op_output(back.id, 0).dims[0] == ("x",)
    grad_sums = [c for c in res.collectives if c.value == back.outputs[0]]
    assert grad_sums and all(c.axis == "y" and c.bytes == 2 * 6 * 4 for c in grad_sums), grad_sums


def test_group_norm_with_its_channels_tiled_in_whole_groups_normalizes_each_device_s_groups_alone():
    """A conv tiled on its output channels feeds GroupNorm without a gather: each device holds whole
    groups, normalizes them with its own statistics (tiled on the group dim) and the step equals
    unsharded; with fewer groups than devices the channels are gathered, as before."""
    from partir_torch.ir import Mesh, Tile
    from tests.rules.harness import run_plan

    def net(groups: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(groups, 8), nn.SiLU(), nn.Conv2d(8, 2, 1))

    torch.manual_seed(0)
    state, res = run_plan(net(4), (r(2, 3, 4, 4),), Mesh.parse("x=4,y=2"),
                          [Tile("0.weight", 0, "x"), Tile("inputs[0]", 0, "y")])
    assert res.max_rel_diff < 1e-5 and res.replica_mismatch < 1e-6, res.diffs
    prog = state.program
    gn = next(o for o in prog.ops if o.target == "aten.native_group_norm.default")
    assert state.op_output(gn.id, 0).dims[:2] == (("y",), ("x",))
    assert state.op_output(gn.id, 1).dims == (("y",), ("x",))  # the [N, G] statistics, a group tile each
    x = gn.inputs[0]
    assert not [c for c in res.collectives if c.value == x and c.axis == "x"], res.collectives
    # two groups over four devices: a device would hold half a group, so the channels are gathered
    state, res = run_plan(net(2), (r(2, 3, 4, 4),), Mesh.parse("x=4,y=2"),
                          [Tile("0.weight", 0, "x"), Tile("inputs[0]", 0, "y")])
    assert res.max_rel_diff < 1e-5, res.diffs
    gn = next(o for o in state.program.ops if o.target == "aten.native_group_norm.default")
    assert state.op_output(gn.id, 0).dims[1] == ()


def test_a_depthwise_convolution_runs_on_the_channels_its_input_is_tiled_on():
    """A pointwise conv tiled on its output channels feeds a depthwise conv (MobileNet's block) without a
    gather: the depthwise conv's groups are its channels, so it runs on each device's own, forward and
    backward, and the step equals unsharded; a grouped conv with channels a group gathers them."""
    from partir_torch.ir import Mesh, Tile
    from tests.rules.harness import run_plan

    def net(groups: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=groups), nn.ReLU(),
                             nn.Conv2d(8, 2, 1))

    torch.manual_seed(0)
    for groups, gathered in ((8, False), (2, True)):
        state, res = run_plan(net(groups), (r(2, 3, 4, 4),), Mesh.parse("x=4,y=2"),
                              [Tile("0.weight", 0, "x"), Tile("inputs[0]", 0, "y")])
        assert res.max_rel_diff < 1e-5 and res.replica_mismatch < 1e-6, res.diffs
        conv = [o for o in state.program.ops if o.target == "aten.convolution.default"][1]
        x = conv.inputs[0]
        assert bool([c for c in res.collectives if c.value == x and c.axis == "x"]) == gathered, res.collectives
        assert (state.op_output(conv.id, 0).dims[1] == ("x",)) != gathered


def test_index_add_with_its_source_rows_tiled_is_a_sum_pending_over_their_axis():
    """Message passing with the edges tiled: each device scatter-adds its edges' messages, the base joins
    the sum once, and the node sums are reduced over the edges' axis (not the messages gathered)."""
    from partir_torch.ir import Mesh, Tile
    from tests.rules.harness import run_plan

    dst = torch.tensor([0, 2, 1, 0, 3, 3, 2, 0])

    class Agg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.msg = nn.Linear(4, 6)

        def forward(self, nodes, edges):
            return nodes.index_add(0, dst, self.msg(edges)) * 2

    torch.manual_seed(0)
    state, res = run_plan(Agg(), (r(4, 6), r(8, 4)), Mesh.parse("x=4,y=2"),
                          [Tile("inputs[1]", 0, "x"), Tile("msg.weight", 0, "y")])
    assert res.max_rel_diff < 1e-5 and res.replica_mismatch < 1e-6, res.diffs
    prog = state.program
    add = next(o for o in prog.ops if o.target == "aten.index_add.default")
    assert state.op_output(add.id, 0).partial == {"x"}
    assert not [c for c in res.collectives if c.value == add.inputs[2] and c.axis == "x"], res.collectives
    assert any(c.value == add.outputs[0] and c.axis == "x" and c.kind in ("all-reduce", "reduce-scatter")
               for c in res.collectives)



def test_a_table_indexed_by_a_batch_tiled_index_sums_its_gradient_over_the_batch():
    """`table[positions]` with the batch tiled (Whisper's position embedding): the backward's accumulating
    index_put adds each device's rows into its own copy of the table, whose sum is reduced over the batch
    axis, instead of gathering the gradient's rows (4 KiB on a Whisper decoder that XLA never gathers)."""
    from partir_torch.ir import Mesh, Tile
    from tests.rules.harness import run_plan

    positions = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [0, 0, 1, 1]])
    m = Lambda(lambda s, x: torch.tanh(x + s.table[positions]), table=r(6, 8))
    state, res = run_plan(m, (r(4, 4, 8),), Mesh.parse("x=2,y=2"), [Tile("inputs[0]", 0, "x")])
    assert res.max_rel_diff < 1e-5 and res.replica_mismatch < 1e-6, res.diffs
    prog = state.program
    put = next(o for o in prog.ops if o.target.startswith("aten.index_put") or "index_put" in o.target)
    assert state.op_output(put.id, 0).partial == {"x"}
    assert not [c for c in res.collectives if c.op == put.id], res.collectives  # nothing gathered for it
    assert any(c.kind == "all-reduce" and c.axis == "x" and prog.values[c.value].name == "grad[table]"
               for c in res.collectives), res.collectives

def _shift_right(s, x):
    """T5's `_shift_right` on a float tensor, and tensors made from another's dtype only."""
    shifted = x.new_zeros(x.shape)
    shifted[:, 1:] = (x * s.w)[:, :-1]
    return shifted + x.new_ones(8, 4) * s.b + x.new_full((8, 4), 2.0)


@SETTINGS
@given(st.data())
def test_new_tensors_made_from_a_tiled_tensor(data):
    check(Lambda(_shift_right, w=r(4), b=r(4)), (r(8, 4),), data)


def test_a_new_tensor_does_not_gather_the_tensor_it_takes_its_dtype_from():
    """`x.new_zeros(shape)` reads only x's dtype and device: with x tiled over the batch, nothing is gathered
    for it (the operand was read replicated, an all-gather XLA never makes: 4 KiB on a Whisper decoder)."""
    from partir_torch.ir import Mesh, Tile
    from partir_torch.lower import lower
    from tests.rules.harness import run_plan

    state, res = run_plan(Lambda(_shift_right, w=r(4), b=r(4)), (r(8, 4),), Mesh.parse("x=2"),
                          [Tile("inputs[0]", 0, "x")])
    p = state.program
    assert not [c for c in lower(state) if c.op >= 0 and p.ops[c.op].target.startswith("aten.new_")]
    assert res.max_rel_diff <= 1e-5 and res.replica_mismatch <= 1e-5
