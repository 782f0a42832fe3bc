"""Elementwise ops (with broadcasting), including the optimizer's arithmetic and like-creation ops.

Every op torch tags `pointwise` gets this rule through the tag (`register_tag`): comparisons, logical and
bitwise ops, `fmod`, `remainder`, `signbit`, … — boolean and integer operands (attention masks, position
ids) tile like any other. The explicit list holds the elementwise ops torch does not tag.
"""

from __future__ import annotations

import torch

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, register, register_tag, spec_rule, tensor_args


def broadcast_spec(program: Program, operands: list[int], result: int) -> str:
    """Align every operand to the result from the right; a size-1 dim against a larger one carries no factor."""
    out = program.values[result].shape
    r = len(out)
    letters = LETTERS[:r] if r <= len(LETTERS) else "".join(chr(0x100 + i) for i in range(r))
    parts = []
    for v in operands:
        shape = program.values[v].shape
        q = len(shape)
        parts.append("".join("_" if (shape[i] == 1 and out[i + r - q] != 1) else letters[i + r - q] for i in range(q)))
    return ",".join(parts) + "->" + letters


@register(
    "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Scalar",
    "aten.rsub.Tensor", "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
    "aten.neg.default", "aten.sqrt.default", "aten.rsqrt.default", "aten.reciprocal.default",
    "aten.pow.Scalar", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.exp.default",
    "aten.log.default", "aten.cos.default", "aten.sin.default", "aten.tanh.default", "aten.abs.default",
    "aten.lerp.Scalar", "aten.lerp.Tensor", "aten.addcmul.default", "aten.addcdiv.default",
    "aten.maximum.default", "aten.minimum.default", "aten.clamp_min.default", "aten.clamp.default",
    "aten.gelu.default", "aten.gelu_backward.default", "aten.silu.default", "aten.silu_backward.default",
    "aten.sigmoid.default", "aten.sigmoid_backward.default", "aten.tanh_backward.default",
    "aten.relu.default", "aten.threshold_backward.default", "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor", "aten.where.self", "aten.gt.Tensor", "aten.gt.Scalar", "aten.lt.Tensor",
    "aten.lt.Scalar", "aten.ge.Tensor", "aten.ge.Scalar", "aten.le.Tensor", "aten.le.Scalar", "aten.eq.Tensor",
    "aten.eq.Scalar", "prims.le.default", "prims.lt.default", "prims.ge.default", "prims.gt.default",
    "prims.eq.default", "prims.where.default",
    "aten.ne.Tensor", "aten.logical_not.default", "aten.clone.default",
    "aten.ones_like.default", "aten.zeros_like.default", "aten.empty_like.default", "aten.full_like.default",
    "aten.fill.Scalar", "aten.detach.default", "aten.copy.default", "aten.lift_fresh_copy.default",
    "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar", "aten.fill.Tensor",
    "prims.copy_to.default", "prims.div.default",
)
@register_tag("pointwise")
def pointwise(op: Op, program: Program) -> OpRule:
    return spec_rule(op, program, broadcast_spec(program, tensor_args(op), op.outputs[0]), name="pointwise")


@register("aten._to_copy.default", "prims.convert_element_type.default")
def cast(op: Op, program: Program) -> OpRule:
    """A cast is elementwise; the mixed-precision policy's widening cast of a gradient (`param_dtype` to
    `reduce_dtype`, `capture/loop.py`) is named `widen`: a pending sum passes through it, so the sum is
    reduced in `reduce_dtype` as the policy asks (exact in float64, where the simulator checks plans)."""
    ins = tensor_args(op)
    name = "widen" if ins and _policy_widening(program, program.values[ins[0]].dtype,
                                               program.values[op.outputs[0]].dtype) else "pointwise"
    return spec_rule(op, program, broadcast_spec(program, ins, op.outputs[0]), name=name)


def _policy_widening(program: Program, src: torch.dtype, dst: torch.dtype) -> bool:
    loop = getattr(program, "loop", None)
    if loop is None or loop.reduce_dtype is None:
        return False
    pdt, rdt = loop.dtype("param_dtype"), loop.dtype("reduce_dtype")
    return src == pdt and dst == rdt and rdt.itemsize > pdt.itemsize
