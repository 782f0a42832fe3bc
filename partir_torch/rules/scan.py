"""Scans, sorts, flips and selections along one dim: that dim is replicated (its result at one position
depends on the whole dim), every other dim passes through."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import LETTERS, OpRule, named_arg, register, spec_rule, tensor_args


def _along(op: Op, program: Program, dims: list[int], name: str) -> OpRule:
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    letters = LETTERS[:r]
    outs = [o for o in op.outputs if o >= 0]
    rep = "".join(letters[d % r] for d in dims) if r else ""
    return spec_rule(op, program, f"{letters}->" + ",".join([letters] * len(outs)), replicate=rep, name=name)


@register("aten.cumsum.default", "aten.cumprod.default", "aten.cummax.default", "aten.cummin.default",
          "aten.logcumsumexp.default")
def scan(op: Op, program: Program) -> OpRule:
    return _along(op, program, [int(named_arg(op, "dim"))], "scan")


@register("aten.sort.default", "aten.sort.stable", "aten.kthvalue.default")
def sort(op: Op, program: Program) -> OpRule:
    return _along(op, program, [int(named_arg(op, "dim", -1))], "sort")


@register("aten.flip.default")
def flip(op: Op, program: Program) -> OpRule:
    return _along(op, program, [int(d) for d in named_arg(op, "dims")], "flip")


@register("aten.roll.default")
def roll(op: Op, program: Program) -> OpRule:
    dims = named_arg(op, "dims", [])
    r = len(program.values[tensor_args(op)[0]].shape)
    return _along(op, program, [int(d) for d in dims] if dims else list(range(r)), "roll")


@register("aten.topk.default")
def topk(op: Op, program: Program) -> OpRule:
    """The k largest along `dim`: that dim is replicated, the others tile."""
    x = tensor_args(op)[0]
    r = len(program.values[x].shape)
    d = int(named_arg(op, "dim", -1)) % r
    letters = LETTERS[:r]
    return spec_rule(op, program, f"{letters}->{letters},{letters}", replicate=letters[d], name="topk")
