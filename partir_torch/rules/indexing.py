"""Gathers, scatters and creation ops. Gathered / scattered dims are data-dependent: replicated, except an
embedding table's rows, which tile as a masked lookup (`embedding`).

Index tensors (integer positions, boolean masks) are side inputs: each of their dims is its own factor that
needs replication, so they are all-gathered if they arrive tiled (the cost lowering charges). Dims of the
indexed tensor that no index touches pass through to the result.
"""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import (
    LETTERS,
    OpRule,
    _fresh,
    arg,
    register,
    replicated_rule,
    spec_rule,
    tensor_args,
)


@register("aten.embedding.default")
def embedding(op: Op, program: Program) -> OpRule:
    """A table tiled on its rows is a masked lookup (Megatron's vocab-parallel embedding): each device looks up
    the indices that fall in its rows and writes zeros for the others, so the result is a pending sum over
    the row axis (an all-reduce of the [.., D] result instead of a gather of the table). The simulator runs
    that local kernel (`simulate.masked_embedding`); XLA's SPMD partitioner lowers the op the same way."""
    idx = tensor_args(op)[1]
    lead = LETTERS[: len(program.values[idx].shape)]
    return spec_rule(op, program, f"VD,{lead}->{lead}D", name="embedding")


@register("aten.embedding_dense_backward.default")
def embedding_dense_backward(op: Op, program: Program) -> OpRule:
    """The table's gradient tiles on its rows as a masked scatter-add: each device adds the token rows whose
    index falls in its rows, so a row-tiled gradient needs the tokens whole on that axis (a gather of the
    `[.., D]` output gradient) instead of a reduce-scatter of the whole `[V, D]` sum."""
    idx = tensor_args(op)[1]
    lead = LETTERS[: len(program.values[idx].shape)]
    return spec_rule(op, program, f"{lead}D,{lead}->VD", name="embedding_backward")


@register("aten.index_select.default")
def index_select(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(arg(op, 1)) % r
    letters = LETTERS[:r]
    out = letters[:d] + "E" + letters[d + 1:]
    return spec_rule(op, program, f"{letters},E->{out}", replicate=letters[d], name="gather")


def _into(op: Op, program: Program) -> tuple[str, str, str]:
    """(the base's letters, the source's, the letter of the scattered-into dim) of index_add / index_copy:
    the source's rows (one per index) are the factor E."""
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(arg(op, 1)) % r
    letters = LETTERS[:r]
    return letters, letters[:d] + "E" + letters[d + 1:], letters[d]


@register("aten.index_add.default")
def index_add(op: Op, program: Program) -> OpRule:
    """The scattered-into dim is data-dependent (replicated); the other dims tile. The source rows (a graph's
    edges) tile as a sum: each device adds its rows, the base joins the sum once (`partialize`) and the
    result is pending over that axis, as an edge-parallel message aggregation is."""
    base, src, into = _into(op, program)
    return spec_rule(op, program, f"{base},E,{src}->{base}", replicate=into, partialize=(0,), name="scatter_add")


@register("aten.index_copy.default")
def index_copy(op: Op, program: Program) -> OpRule:
    """As index_add, but a copy overwrites: the source rows stay whole."""
    base, src, into = _into(op, program)
    return spec_rule(op, program, f"{base},E,{src}->{base}", replicate=into + "E", name="index_copy")


@register("aten.scatter.src", "aten.scatter.value", "aten.gather.default", "aten.scatter_add.default",
          "aten.scatter_reduce.two")
def scatter(op: Op, program: Program) -> OpRule:
    ins = tensor_args(op)
    out = op.outputs[0]
    r = len(program.values[out].shape)
    d = int(arg(op, 1)) % r
    same = [i for i in range(r) if i != d and len({program.values[v].shape[i] for v in [*ins, out]}) == 1]
    letters = LETTERS[:r]
    fresh = _fresh(program, [*ins, out], 0)
    specs = ["".join(letters[i] if i in same else f[i] for i in range(r)) for f in fresh]
    rep = "".join(ch for f in fresh for ch in f)
    return spec_rule(op, program, ",".join(specs[:-1]) + "->" + specs[-1], replicate=rep, name="scatter")


def _index_specs(op: Op, program: Program, x: int, indices: list) -> tuple[str, list[str], str, str]:
    """Specs for `x[indices]` (`indices` a list with None for untouched dims): x's spec, the index tensors'
    specs, the result's spec and the factors to replicate. Untouched dims pass through: with the index
    tensors adjacent (`h[:, idx]`) the result keeps them around the index shape, otherwise after it."""
    xr = len(program.values[x].shape)
    pos = [i for i, t in enumerate(indices) if t is not None]
    idx_vals = [t.id for t in indices if t is not None]
    bshape = max((len(program.values[v].shape) for v in idx_vals), default=0)
    hidden = _fresh(program, [x], 1 << 11)[0]  # indexed dims of x: factors of their own, replicated
    xl = [hidden[d] if d in pos else LETTERS[d] for d in range(xr)]
    widest = max(idx_vals, key=lambda v: len(program.values[v].shape), default=None)
    bl = _fresh(program, [widest], 1 << 10)[0] if widest is not None else ""  # the broadcast index's dims
    # (from the widest index, not the result: `index_put`'s result is x, which may have fewer dims)
    if pos and pos == list(range(pos[0], pos[-1] + 1)):
        out = "".join(xl[: pos[0]]) + bl + "".join(xl[pos[-1] + 1:])
    else:
        out = bl + "".join(xl[d] for d in range(xr) if d not in pos)
    ispecs = [bl[bshape - len(program.values[v].shape):] for v in idx_vals]
    return "".join(xl), ispecs, out, hidden + bl


@register("aten._unsafe_index.Tensor", "aten.index.Tensor")
def index(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    xs, ispecs, out, rep = _index_specs(op, program, x, list(arg(op, 1)))
    return spec_rule(op, program, ",".join([xs, *ispecs]) + "->" + out, replicate=rep, name="index")


@register("aten.index_put.default", "aten._unsafe_index_put.default")
def index_put(op: Op, program: Program) -> OpRule:
    """`x[indices] = values` (or `+=` with accumulate): `values` is aligned to `x[indices]` from the right;
    the dims no index touches tile in x, values and the result alike. With accumulate, the index's own dims
    (an embedding backward's tokens) tile as a sum, as index_add's rows do: each device adds its values, x
    joins the sum once and the result is pending over the axis (a put that overwrites keeps them whole)."""
    x, *_ = tensor_args(op)
    indices = list(arg(op, 1))
    values = tensor_args(op)[-1]
    xs, ispecs, sel, rep = _index_specs(op, program, x, indices)
    vshape, n = program.values[values].shape, len(sel)
    sel_shape = _index_shape(program, x, indices)
    vs = "".join("_" if (vshape[i] == 1 and sel_shape[n - len(vshape) + i] != 1) else sel[n - len(vshape) + i]
                 for i in range(len(vshape)))
    spec = ",".join([xs, *ispecs, vs]) + "->" + xs
    if arg(op, 3, "accumulate", False):
        hidden = "".join(xs[d] for d in range(len(xs)) if d < len(indices) and indices[d] is not None)
        return spec_rule(op, program, spec, replicate=hidden, partialize=(0,), name="index_put_add")
    return spec_rule(op, program, spec, replicate=rep, reduced=("",), name="index_put")


def _index_shape(program: Program, x: int, indices: list) -> list[int]:
    """The shape of `x[indices]` (what `index` returns)."""
    import torch

    xs = torch.empty(program.values[x].shape, device="meta")
    idx = [None if t is None else torch.zeros(program.values[t.id].shape, dtype=program.values[t.id].dtype,
                                               device="meta") for t in indices]
    return list(torch.ops.aten.index.Tensor(xs, idx).shape)


@register("aten._embedding_bag.default", "aten._embedding_bag_forward_only.default")
def embedding_bag(op: Op, program: Program) -> OpRule:
    """Bags of rows of the table: the embedding dim tiles; rows, bags and offsets are data-dependent."""
    ins, outs = tensor_args(op), [o for o in op.outputs if o >= 0]
    fresh = _fresh(program, [*ins, *outs], 0)
    specs = [f for f in fresh]
    specs[0] = fresh[0][0] + "D"  # weight [V, D]
    out0 = len(ins)
    specs[out0] = fresh[out0][0] + "D"  # result [bags, D]
    rep = "".join(ch for f in fresh for ch in f)
    return spec_rule(op, program, ",".join(specs[:out0]) + "->" + ",".join(specs[out0:]), replicate=rep,
                     reduced=("",) * len(outs), name="embedding_bag")


@register("aten._embedding_bag_backward.default", "aten._embedding_bag_dense_backward.default")
def embedding_bag_backward(op: Op, program: Program) -> OpRule:
    ins, out = tensor_args(op), op.outputs[0]
    fresh = _fresh(program, [*ins, out], 0)
    specs = list(fresh)
    specs[0] = fresh[0][0] + "D"  # grad [bags, D]
    specs[-1] = fresh[-1][0] + "D"  # grad of the table [V, D]
    rep = "".join(ch for f in fresh for ch in f)
    return spec_rule(op, program, ",".join(specs[:-1]) + "->" + specs[-1], replicate=rep, reduced=("",),
                     name="embedding_bag_backward")


@register("aten.masked_scatter.default", "aten.masked_scatter_backward.default", "aten.nonzero.default",
          "aten.masked_select.default", "aten.as_strided.default", "aten.as_strided_scatter.default")
def packed(op: Op, program: Program) -> OpRule:
    """Ops that pack or unpack the selected elements in global order, and raw strided views (autograd's
    gradient of an in-place write into a view): every dim stays replicated."""
    return replicated_rule(op, program)


@register("aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default",
          "aten.new_empty_strided.default")
def new_fill(op: Op, program: Program) -> OpRule:
    """A new tensor of a given size; the tensor argument only supplies dtype and device, so it is no operand:
    its sharding is never needed (as an operand read replicated, T5's `_shift_right` and an embedding's
    backward were planned to gather it; XLA does not)."""
    r = len(program.values[op.outputs[0]].shape)
    return spec_rule(op, program, "->" + LETTERS[:r], operands=[], name="fill")


@register("aten.upsample_nearest2d_backward.default", "aten.upsample_nearest2d.default",
          "aten.upsample_bilinear2d.default", "aten.upsample_bilinear2d_backward.default",
          "aten.upsample_nearest2d.vec", "aten.upsample_bilinear2d.vec", "aten.upsample_nearest1d.default",
          "aten.upsample_nearest1d_backward.default", "aten.upsample_linear1d.default",
          "aten.upsample_linear1d_backward.default", "aten.upsample_nearest3d.default",
          "aten.upsample_nearest3d_backward.default", "aten.upsample_bicubic2d.default",
          "aten.upsample_bicubic2d_backward.default", "aten._adaptive_avg_pool2d.default",
          "aten._adaptive_avg_pool2d_backward.default", "aten.adaptive_max_pool2d.default",
          "aten.adaptive_max_pool2d_backward.default", "aten.max_pool1d_with_indices.default",
          "aten.avg_pool1d.default",
          "aten.max_pool2d_with_indices.default", "aten.max_pool2d_with_indices_backward.default",
          "aten.avg_pool2d.default", "aten.avg_pool2d_backward.default")
def spatial(op: Op, program: Program) -> OpRule:
    """Resampling and pooling: batch and channels tile, spatial dims need neighbours."""
    ins, outs = tensor_args(op), [o for o in op.outputs if o >= 0]
    fresh = _fresh(program, [*ins, *outs], 0)
    specs = ["nc" + f[2:] if len(f) >= 2 else f for f in fresh]
    rep = "".join(ch for f in fresh for ch in f[2:])
    return spec_rule(op, program, ",".join(specs[: len(ins)]) + "->" + ",".join(specs[len(ins):]), replicate=rep,
                     name="spatial")


@register("aten.zeros.default", "aten.ones.default", "aten.full.default", "aten.empty.memory_format",
          "aten.scalar_tensor.default")
def fill(op: Op, program: Program) -> OpRule:
    r = len(program.values[op.outputs[0]].shape)
    return spec_rule(op, program, "->" + LETTERS[:r], name="fill")


@register("aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.linspace.default")
def arange(op: Op, program: Program) -> OpRule:
    return spec_rule(op, program, "->a", replicate="a", name="arange")
