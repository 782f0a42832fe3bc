"""Convolutions: batch and channels tile; spatial dims need halos, so they stay replicated. A grouped
convolution runs with its channels whole, but a depthwise one, whose channels are its groups, tiles them."""

from __future__ import annotations

from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import OpRule, arg, register, spec_rule, tensor_args

_SP_IN, _SP_OUT, _SP_K = "HWD", "PQR", "KLM"


def depthwise(in_channels: int, weight_shape, groups: int) -> bool:
    """Whether a convolution (plain or transposed) is depthwise without a multiplier: a group per channel, in
    and out. Its channels are then independent, and tile like its batch (the group is the channel); the
    engine (`backends/xla`) asks the same of a module, so that both treat the same convolutions so."""
    return groups > 1 and in_channels == groups and weight_shape[0] == groups and weight_shape[1] == 1


def _depthwise(program: Program, x: int, w: int, groups: int) -> bool:
    return depthwise(program.values[x].shape[1], program.values[w].shape, groups)


@register("aten.convolution.default")
def convolution(op: Op, program: Program) -> OpRule:
    x = tensor_args(op)[0]
    nsp = len(program.values[x].shape) - 2
    transposed, groups = bool(arg(op, 6)), int(arg(op, 8))
    if _depthwise(program, x, tensor_args(op)[1], groups):
        specs = ["ng" + _SP_IN[:nsp], "g_" + _SP_K[:nsp]] + (["g"] if arg(op, 2) is not None else [])
        return spec_rule(op, program, ",".join(specs) + "->ng" + _SP_OUT[:nsp], replicate=_SP_IN + _SP_OUT + _SP_K,
                         partialize=(2,), name="convolution")
    specs = ["ni" + _SP_IN[:nsp], "oi" + _SP_K[:nsp]] if not transposed else ["ni" + _SP_IN[:nsp], "io" + _SP_K[:nsp]]
    if arg(op, 2) is not None:
        specs.append("o")
    rep = _SP_IN + _SP_OUT + _SP_K + ("io" if groups != 1 or transposed else "")
    return spec_rule(op, program, ",".join(specs) + "->no" + _SP_OUT[:nsp], replicate=rep, partialize=(2,),
                     name="convolution")


@register("aten.convolution_backward.default")
def convolution_backward(op: Op, program: Program) -> OpRule:
    g = tensor_args(op)[0]
    nsp = len(program.values[g].shape) - 2
    transposed, groups = bool(arg(op, 7)), int(arg(op, 9))
    if _depthwise(program, tensor_args(op)[1], tensor_args(op)[2], groups):
        full = ["ng" + _SP_IN[:nsp], "g_" + _SP_K[:nsp], "g"]
        sums = [_SP_OUT[:nsp] + _SP_K[:nsp], "n" + _SP_OUT[:nsp] + _SP_IN[:nsp], "n" + _SP_OUT[:nsp]]
        res = [s for s, o in zip(full, op.outputs) if o >= 0]
        red = tuple(s for s, o in zip(sums, op.outputs) if o >= 0)
        spec = f"ng{_SP_OUT[:nsp]},ng{_SP_IN[:nsp]},g_{_SP_K[:nsp]}->" + ",".join(res)
        return spec_rule(op, program, spec, replicate=_SP_IN + _SP_OUT + _SP_K, reduced=red,
                         name="convolution_backward")
    full = ["ni" + _SP_IN[:nsp], "oi" + _SP_K[:nsp], "o"]
    # grad_x sums over output channels; grad_w and grad_b over the batch (and positions)
    sums = ["o" + _SP_OUT[:nsp] + _SP_K[:nsp], "n" + _SP_OUT[:nsp] + _SP_IN[:nsp], "n" + _SP_OUT[:nsp]]
    res = [s for s, o in zip(full, op.outputs) if o >= 0]
    red = tuple(s for s, o in zip(sums, op.outputs) if o >= 0)
    rep = _SP_IN + _SP_OUT + _SP_K + ("io" if groups != 1 or transposed else "")
    spec = f"no{_SP_OUT[:nsp]},ni{_SP_IN[:nsp]},oi{_SP_K[:nsp]}->" + ",".join(res)
    return spec_rule(op, program, spec, replicate=rep, reduced=red, name="convolution_backward")
