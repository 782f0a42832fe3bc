"""Views and data movement: reshape groups, transposes, broadcasts, slicing, concatenation.

Reshape (`view`, `_unsafe_view`, `squeeze`, `unsqueeze`) pairs groups of input and output dims with equal
products. A 1:1 group keeps its factor; in a merge or split only the *major* dim of each side carries the
group's factor (tiling the major dim of a row-major group by k is the same contiguous chunk on both sides
when k divides both major dims); the minor dims carry none, so their tilings do not propagate.

Split into n equal parts and concat of n equal parts keep the split dim's factor: each part is tiled alike,
and the whole tensor is read (split) or written (cat) in n chunks (`Sharding.chunks`). Against a blocked
tiling that is an all-to-all of the local block, which is what XLA's SPMD partitioner does for GPT-2's fused
QKV under Megatron (an all-gather would move the whole tensor). Unequal parts keep the dim replicated.
"""

from __future__ import annotations

from dataclasses import replace

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, arg, named_arg, register, spec_rule, tensor_args


def reshape_spec(a: tuple[int, ...], b: tuple[int, ...]) -> str:
    left, right = ["_"] * len(a), ["_"] * len(b)
    i = j = k = 0
    while i < len(a) and j < len(b):
        if a[i] == 1:
            i += 1
            continue
        if b[j] == 1:
            j += 1
            continue
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                pb *= b[j]
                gj.append(j)
                j += 1
        left[gi[0]] = right[gj[0]] = LETTERS[k] if k < 26 else chr(0x100 + k)
        k += 1
    return "".join(left) + "->" + "".join(right)


@register("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.squeeze.dim",
          "aten.squeeze.dims", "aten.view_copy.default",
          "aten.squeeze.default", "aten.unsqueeze.default", "aten.alias.default")
def reshape(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    spec = reshape_spec(program.values[x].shape, program.values[op.outputs[0]].shape)
    return spec_rule(op, program, spec, name="reshape")


def _perm_rule(op: Op, program: Program, perm: list[int]) -> OpRule:
    letters = LETTERS[: len(perm)]
    return spec_rule(op, program, letters + "->" + "".join(letters[p] for p in perm), name="permute")


@register("aten.t.default")
def t(op: Op, program: Program) -> OpRule:
    r = len(program.values[tensor_args(op)[0]].shape)
    return _perm_rule(op, program, [1, 0][:r] if r == 2 else list(range(r)))


@register("aten.transpose.int")
def transpose(op: Op, program: Program) -> OpRule:
    r = len(program.values[tensor_args(op)[0]].shape)
    perm = list(range(r))
    d0, d1 = int(arg(op, 1)) % r, int(arg(op, 2)) % r
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _perm_rule(op, program, perm)


@register("aten.permute.default")
def permute(op: Op, program: Program) -> OpRule:
    r = len(program.values[tensor_args(op)[0]].shape)
    return _perm_rule(op, program, [int(d) % r for d in arg(op, 1)])


@register("aten.expand.default", "aten.expand_copy.default")
def expand(op: Op, program: Program) -> OpRule:
    from partir_torch.rules.pointwise import broadcast_spec

    return spec_rule(op, program, broadcast_spec(program, tensor_args(op), op.outputs[0]), name="broadcast")


@register("aten.select.int")
def select(op: Op, program: Program) -> OpRule:
    r = len(program.values[tensor_args(op)[0]].shape)
    d = int(arg(op, 1)) % r
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters}->{letters[:d] + letters[d + 1:]}", replicate=letters[d], name="select")


@register("aten.select_backward.default")
def select_backward(op: Op, program: Program) -> OpRule:
    r = len(program.values[op.outputs[0]].shape)
    d = int(arg(op, 2)) % r
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters[:d] + letters[d + 1:]}->{letters[:d]}_{letters[d + 1:]}",
                     name="select_backward")


@register("aten.slice.Tensor")
def slice_(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    shape = program.values[x].shape
    r = len(shape)
    d = int(arg(op, 1, "dim", 0)) % r
    start, end, step = arg(op, 2, "start"), arg(op, 3, "end"), arg(op, 4, "step", 1)
    full = (start in (None, 0)) and (end is None or end >= shape[d]) and step in (None, 1)
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters}->{letters}", replicate="" if full else letters[d], name="slice")


@register("aten.cat.default")
def cat(op: Op, program: Program) -> OpRule:
    """n equal parts along `dim` (GPT-2's QKV gradient): every part tiled alike, the result written in n chunks
    (`Sharding.chunks`: an all-to-all to blocks); unequal parts: the dim stays replicated."""
    ins = tensor_args(op)
    r = len(program.values[op.outputs[0]].shape)
    d = int(arg(op, 1, "dim", 0)) % r
    letters = LETTERS[:r]
    specs = [letters if len(program.values[v].shape) == r else "_" * len(program.values[v].shape) for v in ins]
    spec = ",".join(specs) + "->" + letters
    ranks_ok = all(len(program.values[v].shape) == r for v in ins)
    if len(ins) < 2 or not ranks_ok or len({program.values[v].shape[d] for v in ins}) != 1:
        return spec_rule(op, program, spec, replicate=letters[d], name="concat")
    rule = spec_rule(op, program, spec, name="concat")
    return replace(rule, results=(replace(rule.results[0], chunks=((d, len(ins)),)),))


@register("aten.split.Tensor", "aten.split_with_sizes.default", "aten.unsafe_split.Tensor",
          "aten.unsafe_split_with_sizes.default")
def split(op: Op, program: Program) -> OpRule:
    """Into n equal parts (GPT-2's fused QKV): the operand read in n chunks (`Sharding.chunks`: a blocked
    operand costs an all-to-all), every part tiled alike; unequal parts: the dim stays replicated."""
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(arg(op, 2, "dim", 0)) % r
    letters = LETTERS[:r]
    outs = [o for o in op.outputs if o >= 0]
    size, full = arg(op, 1), program.values[x].shape[d]
    if isinstance(size, int):
        parts = [size] * (full // size) if full % size == 0 else []
    else:
        parts = list(size)
    spec = f"{letters}->" + ",".join([letters] * len(outs))
    if len(parts) < 2 or len(set(parts)) != 1:
        return spec_rule(op, program, spec, replicate=letters[d], name="split")
    rule = spec_rule(op, program, spec, name="split")
    return replace(rule, operands=(replace(rule.operands[0], chunks=((d, len(parts)),)),))


@register("aten.slice_backward.default")
def slice_backward(op: Op, program: Program) -> OpRule:
    """The gradient of a slice: zeros with the slice written back; the sliced dim stays replicated."""
    r = len(program.values[op.outputs[0]].shape)
    d = int(arg(op, 2)) % r
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters}->{letters}", replicate=letters[d], name="slice_backward")


@register("aten.stack.default")
def stack(op: Op, program: Program) -> OpRule:
    """Equal-shaped parts stacked on a new dim: the other dims pass, the new dim carries no factor."""
    ins = tensor_args(op)
    r = len(program.values[op.outputs[0]].shape)
    d = int(arg(op, 1, "dim", 0)) % r
    letters = LETTERS[: r - 1]
    out = letters[:d] + "_" + letters[d:]
    return spec_rule(op, program, ",".join([letters] * len(ins)) + "->" + out, reduced=("",), name="stack")


@register("aten.unbind.int")
def unbind(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(arg(op, 1, "dim", 0)) % r
    letters = LETTERS[: r - 1]
    outs = [o for o in op.outputs if o >= 0]
    return spec_rule(op, program, f"{letters[:d]}_{letters[d:]}->" + ",".join([letters] * len(outs)),
                     reduced=("",) * len(outs), name="unbind")


@register("aten.constant_pad_nd.default")
def constant_pad(op: Op, program: Program) -> OpRule:
    """Padded dims (pairs from the last dim backwards) stay replicated; the others tile."""
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    pad = list(arg(op, 1))
    padded = {r - 1 - i // 2 for i, p in enumerate(pad) if p}
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters}->{letters}", replicate="".join(letters[d] for d in padded),
                     name="pad")


@register("aten.tril.default", "aten.triu.default")
def triangle(op: Op, program: Program) -> OpRule:
    """A triangular mask compares global row and column positions: the last two dims stay replicated."""
    r = len(program.values[tensor_args(op)[0]].shape)
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters}->{letters}", replicate=letters[-2:], name="triangle")


@register("aten.repeat.default")
def repeat(op: Op, program: Program) -> OpRule:
    """Repeated dims (and new leading ones) stay replicated; dims repeated once pass."""
    x = tensor_args(op)[0]
    r, reps = len(program.values[x].shape), list(arg(op, 1))
    lead = len(reps) - r
    letters = LETTERS[:r]
    out = "_" * lead + "".join(c if reps[lead + i] == 1 else "_" for i, c in enumerate(letters))
    rep = "".join(c for i, c in enumerate(letters) if reps[lead + i] != 1)
    return spec_rule(op, program, f"{letters}->{out}", replicate=rep, reduced=("",), name="repeat")


@register("aten.slice_scatter.default")
def slice_scatter(op: Op, program: Program) -> OpRule:
    """`src` written into a slice of `x` along `dim`: that dim stays replicated, the others tile."""
    r = len(program.values[op.outputs[0]].shape)
    d = int(named_arg(op, "dim", 0)) % r
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters},{letters}->{letters}", replicate=letters[d], name="slice_scatter")


@register("aten.select_scatter.default")
def select_scatter(op: Op, program: Program) -> OpRule:
    r = len(program.values[op.outputs[0]].shape)
    d = int(arg(op, 2)) % r
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters},{letters[:d] + letters[d + 1:]}->{letters}", replicate=letters[d],
                     name="select_scatter")
