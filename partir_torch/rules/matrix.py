"""Matmul-like ops, generated from einsum strings. The contracted factor makes the result partial."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import OpRule, register, spec_rule, tensor_args


@register("aten.mm.default")
def mm(op: Op, program: Program) -> OpRule:
    return spec_rule(op, program, "mk,kn->mn", name="mm")


@register("aten.bmm.default")
def bmm(op: Op, program: Program) -> OpRule:
    return spec_rule(op, program, "bmk,bkn->bmn", name="bmm")


@register("aten.addmm.default")
def addmm(op: Op, program: Program) -> OpRule:
    """bias + a @ b: with k tiled the bias joins the partial sum once (`partialize`), not once per device."""
    bias = program.values[tensor_args(op)[0]].shape
    out = program.values[op.outputs[0]].shape
    b = "".join("_" if s == 1 and o != 1 else c for s, c, o in zip(bias, "mn"[2 - len(bias):], out[2 - len(bias):]))
    return spec_rule(op, program, f"{b},mk,kn->mn", partialize=(0,), name="addmm")
