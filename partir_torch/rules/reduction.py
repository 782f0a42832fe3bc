"""Reductions: a reduced factor makes the result partial (a sum) when tiled; `mean` also scales it."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, arg, named_arg, register, spec_rule, tensor_args


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


@register("aten.prod.dim_int", "aten.prod.default", "aten.amax.default", "aten.amin.default",
          "aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default", "aten.any.dim",
          "aten.any.dims", "aten.any.default", "aten.all.dim", "aten.all.default", "aten.logsumexp.default",
          "aten.max.default", "aten.min.default", "aten.var.correction", "aten.std.correction",
          "aten.var_mean.correction", "aten.median.dim", "aten.mode.default")
def non_sum(op: Op, program: Program) -> OpRule:
    """Reductions that are not sums (products, extrema, arg-extrema, logical, variances): the reduced dims
    stay replicated, the others tile."""
    dims = named_arg(op, "dim")
    dims = [dims] if isinstance(dims, int) else dims
    keep = bool(named_arg(op, "keepdim", False))
    spec, red = _reduce_spec(op, program, dims, keep)
    lhs, _, rhs = spec.partition("->")
    n = len([o for o in op.outputs if o >= 0])
    return spec_rule(op, program, lhs + "->" + ",".join([rhs] * n), replicate=red, name="reduce")
