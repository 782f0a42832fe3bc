"""Losses. A mean over a tiled batch is a partial sum of local means scaled by the tiling."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, arg, register, spec_rule, tensor_args

_MEAN, _SUM = 1, 2


@register("aten.nll_loss_forward.default")
def nll_loss_forward(op: Op, program: Program) -> OpRule:
    x, *_ = tensor_args(op)
    batched = len(program.values[x].shape) == 2
    n = "n" if batched else ""
    red = int(arg(op, 3))
    out = n if red not in (_MEAN, _SUM) else ""
    ins = [n + "C", n] + (["C"] if arg(op, 2) is not None else [])
    # the mean divides by the local total weight; scaled by the tiling that is the global mean
    return spec_rule(op, program, ",".join(ins) + f"->{out},", replicate="C",
                     mean=(n if red == _MEAN else "", ""), name="nll_loss")


@register("aten.nll_loss_backward.default")
def nll_loss_backward(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[1]
    n = "n" if len(program.values[x].shape) == 2 else ""
    g = tensor_args(op)[0]
    gspec = n if len(program.values[g].shape) == 1 else ""
    ins = [gspec, n + "C", n] + (["C"] if arg(op, 3) is not None else []) + [""]
    # grad = -grad_out * w[target] / total_weight, with total_weight the (all-reduced) global weight
    return spec_rule(op, program, ",".join(ins) + f"->{n}C", replicate="C", name="nll_loss_backward")


@register("aten.mse_loss.default")
def mse_loss(op: Op, program: Program) -> OpRule:
    r = len(program.values[tensor_args(op)[0]].shape)
    letters = LETTERS[:r]
    red = int(arg(op, 2, "reduction", _MEAN))
    out = letters if red not in (_MEAN, _SUM) else ""
    return spec_rule(op, program, f"{letters},{letters}->{out}", mean=letters if red == _MEAN else "", name="mse_loss")


@register("aten.mse_loss_backward.default")
def mse_loss_backward(op: Op, program: Program) -> OpRule:
    r = len(program.values[tensor_args(op)[1]].shape)
    letters = LETTERS[:r]
    g = len(program.values[tensor_args(op)[0]].shape)
    red = int(arg(op, 3, "reduction", _MEAN))
    # the gradient of a mean divides by the local element count: scale by the tiling
    return spec_rule(op, program, f"{letters[r - g:]},{letters},{letters}->{letters}",
                     mean=letters if red == _MEAN else "", name="mse_loss_backward")
