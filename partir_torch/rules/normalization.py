"""Normalizations and softmax: the normalized dims are reductions inside the op, so they stay replicated."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, arg, register, spec_rule, tensor_args

_NORM = "UVWXYZ"


def _ln_letters(program: Program, x: int, k: int) -> tuple[str, str]:
    r = len(program.values[x].shape)
    return LETTERS[: r - k], _NORM[:k]


@register("aten.native_layer_norm.default")
def native_layer_norm(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    lead, norm = _ln_letters(program, x, len(arg(op, 1)))
    ins = [lead + norm] + [norm for i in (2, 3) if arg(op, i) is not None]
    stat = lead + "_" * len(norm)
    return spec_rule(op, program, ",".join(ins) + f"->{lead + norm},{stat},{stat}", replicate=norm, name="layer_norm")


@register("aten.native_layer_norm_backward.default")
def native_layer_norm_backward(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[1]
    lead, norm = _ln_letters(program, x, len(arg(op, 2)))
    stat = lead + "_" * len(norm)
    ins = [lead + norm, lead + norm, stat, stat] + [norm for i in (5, 6) if arg(op, i) is not None]
    outs = [s for s, o in zip([lead + norm, norm, norm], op.outputs) if o >= 0]
    return spec_rule(op, program, ",".join(ins) + "->" + ",".join(outs), replicate=norm, name="layer_norm_backward")


@register("aten.native_group_norm.default")
def native_group_norm(op: Op, program: Program) -> OpRule:
    """Channels tile in whole groups: the channel factor is also the group dim of the `[N, G]` statistics, so
    a device holding C/k consecutive channels holds G/k whole groups (k must divide G, which the statistics'
    dim checks) and normalizes them alone; the simulator runs it with C/k channels in G/k groups."""
    x = tensor_args(op)[0]
    sp = _NORM[: len(program.values[x].shape) - 2]
    ins = ["nc" + sp] + ["c" for i in (1, 2) if arg(op, i) is not None]
    return spec_rule(op, program, ",".join(ins) + f"->nc{sp},nc,nc", replicate=sp, name="group_norm")


def _softmax_spec(op: Op, program: Program, n_in: int, dim_arg: int) -> tuple[str, str]:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    letters = LETTERS[:r]
    d = int(arg(op, dim_arg)) % r if r else 0
    return ",".join([letters] * n_in) + "->" + letters, letters[d] if r else ""


@register("aten._softmax.default", "aten._log_softmax.default", "aten._safe_softmax.default")
def softmax(op: Op, program: Program) -> OpRule:
    spec, rep = _softmax_spec(op, program, 1, 1)
    return spec_rule(op, program, spec, replicate=rep, name="softmax")


@register("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
def softmax_backward(op: Op, program: Program) -> OpRule:
    spec, rep = _softmax_spec(op, program, 2, 2)
    return spec_rule(op, program, spec, replicate=rep, name="softmax_backward")
