"""Random ops (dropout's `bernoulli`, `rand_like`, …): elementwise in the shape of their result.

A sharded random op must draw, on each device, exactly the tile of the tensor the unsharded program draws:
the random stream is indexed by the global element, not by the device (DTensor's offset-based RNG tracker
does this with Philox offsets). So the rule lets every dim tile freely and costs no communication, and the
simulator (`simulate.py`) keeps numerics by drawing the whole tensor once from the global generator, in
program order and from the same seed as the unsharded run, and giving each device its tile. The operand of
a like-op (`bernoulli(x, p)`) only supplies shape and dtype; its values are never read.
"""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, register, spec_rule, tensor_args
from partir_torch.rules.pointwise import broadcast_spec

SEEDED_TAG = "nondeterministic_seeded"


@register("aten.bernoulli.p", "aten.bernoulli.default", "aten.bernoulli.Tensor", "aten.rand_like.default",
          "aten.randn_like.default", "aten.randint_like.default", "aten.randint_like.low_dtype",
          "aten.native_dropout.default", "aten.uniform.default", "aten.normal.Tensor_float",
          "aten.exponential.default")
def random_like(op: Op, program: Program) -> OpRule:
    outs = [o for o in op.outputs if o >= 0]
    spec = broadcast_spec(program, tensor_args(op), outs[0])
    lhs, _, rhs = spec.partition("->")
    return spec_rule(op, program, lhs + "->" + ",".join([rhs] * len(outs)), name="random")


@register("aten.rand.default", "aten.randn.default", "aten.randint.default", "aten.randint.low")
def random_fill(op: Op, program: Program) -> OpRule:
    r = len(program.values[op.outputs[0]].shape)
    return spec_rule(op, program, "->" + LETTERS[:r], name="random")
