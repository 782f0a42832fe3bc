"""Gathers, scatters and creation ops. Gathered / scattered dims are data-dependent: replicated."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, _fresh, arg, register, spec_rule, tensor_args


@register("aten.embedding.default")
def embedding(op: Op, program: Program) -> OpRule:
    idx = tensor_args(op)[1]
    lead = LETTERS[: len(program.values[idx].shape)]
    return spec_rule(op, program, f"VD,{lead}->{lead}D", replicate="V", name="embedding")


@register("aten.embedding_dense_backward.default")
def embedding_dense_backward(op: Op, program: Program) -> OpRule:
    idx = tensor_args(op)[1]
    lead = LETTERS[: len(program.values[idx].shape)]
    return spec_rule(op, program, f"{lead}D,{lead}->_D", name="embedding_backward")


@register("aten.index_select.default")
def index_select(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(arg(op, 1)) % r
    letters = LETTERS[:r]
    out = letters[:d] + "E" + letters[d + 1:]
    return spec_rule(op, program, f"{letters},E->{out}", replicate=letters[d], name="gather")


@register("aten.index_add.default")
def index_add(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(arg(op, 1)) % r
    letters = LETTERS[:r]
    src = letters[:d] + "E" + letters[d + 1:]
    # the scattered-into dim and the source rows are data-dependent; the other dims tile
    return spec_rule(op, program, f"{letters},E,{src}->{letters}", replicate=letters[d] + "E", name="scatter_add")


@register("aten.scatter.src", "aten.scatter.value", "aten.gather.default")
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


@register("aten._unsafe_index.Tensor", "aten.index.Tensor")
def index(op: Op, program: Program) -> OpRule:
    idx = list(arg(op, 1))
    lead = 0
    while lead < len(idx) and idx[lead] is None:
        lead += 1
    fresh = _fresh(program, [*tensor_args(op), op.outputs[0]], 0)
    xs = LETTERS[:lead] + fresh[0][lead:]
    outs = LETTERS[:lead] + fresh[-1][lead:]
    rep = "".join(ch for f in fresh for ch in f)
    return spec_rule(op, program, ",".join([xs, *fresh[1:-1]]) + "->" + outs, replicate=rep, name="index")


@register("aten.upsample_nearest2d_backward.default", "aten.upsample_nearest2d.default",
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
