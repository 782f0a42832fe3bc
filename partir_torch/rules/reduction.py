"""Reductions: a reduced factor makes the result partial (a sum) when tiled; `mean` also scales it."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, arg, register, spec_rule, tensor_args


def _reduce_spec(op: Op, program: Program, dims, keepdim: bool) -> tuple[str, str]:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    letters = LETTERS[:r]
    red = set(range(r)) if dims is None or len(dims) == 0 else {int(d) % r for d in dims}
    out = "".join(("_" if keepdim else "") if i in red else c for i, c in enumerate(letters))
    return f"{letters}->{out}", "".join(letters[i] for i in sorted(red))


@register("aten.sum.dim_IntList", "aten.sum.default")
def sum_(op: Op, program: Program) -> OpRule:
    dims = arg(op, 1) if op.target == "aten.sum.dim_IntList" else None
    spec, _ = _reduce_spec(op, program, dims, bool(arg(op, 2, "keepdim", False)))
    return spec_rule(op, program, spec, name="sum")


@register("aten.mean.dim", "aten.mean.default")
def mean(op: Op, program: Program) -> OpRule:
    dims = arg(op, 1) if op.target == "aten.mean.dim" else None
    spec, red = _reduce_spec(op, program, dims, bool(arg(op, 2, "keepdim", False)))
    return spec_rule(op, program, spec, mean=red, name="mean")


@register("aten.cumsum.default")
def cumsum(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    return spec_rule(op, program, f"{LETTERS[:r]}->{LETTERS[:r]}", replicate=LETTERS[int(arg(op, 1)) % r], name="scan")


@register("aten.topk.default")
def topk(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(arg(op, 2, "dim", -1)) % r
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters}->{letters},{letters}", replicate=letters[d], name="topk")
