"""Fused attention: batch and heads tile; query/key positions and head dims are coupled by the softmax."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import OpRule, register, spec_rule, tensor_args

_REP = "LSEF"


def _mask_spec(program: Program, v: int) -> str:
    r = len(program.values[v].shape)
    return "bhLS"[4 - r:] if r <= 4 else "_" * r


@register("aten._scaled_dot_product_flash_attention_for_cpu.default")
def sdpa_flash_cpu(op: Op, program: Program) -> OpRule:
    ins = tensor_args(op)
    specs = ["bhLE", "bhSE", "bhSF"] + [_mask_spec(program, v) for v in ins[3:]]
    return spec_rule(op, program, ",".join(specs) + "->bhLF,bhL", replicate=_REP, name="attention")


@register("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
def sdpa_flash_cpu_backward(op: Op, program: Program) -> OpRule:
    ins = tensor_args(op)
    specs = ["bhLF", "bhLE", "bhSE", "bhSF", "bhLF", "bhL"] + [_mask_spec(program, v) for v in ins[6:]]
    return spec_rule(op, program, ",".join(specs) + "->bhLE,bhSE,bhSF", replicate=_REP, name="attention_backward")
