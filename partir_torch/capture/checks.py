"""Checks on a captured step that fake tensors do not make: functional ops only, and the dtypes real torch wants."""

from __future__ import annotations

import math
from typing import Any

import torch

from partir_torch.errors import CaptureError
from partir_torch.ir.program import Program, Ref

aten = torch.ops.aten


def check_functional(gm: torch.fx.GraphModule) -> None:
    """No op of the captured program may write its arguments (except the final buffer copies)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is aten.copy_.default:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            raise CaptureError(
                f"operator {node.target} writes one of its inputs in place and could not be made functional; "
                "use its out-of-place form in the model, or report the op so a functional rewrite is added"
            )


# ops whose CPU/GPU kernels require one dtype for their tensor operands, which their fake (meta) kernels do not
# check: torch would reject the step at its first real run
_SAME_DTYPE = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
               "aten.addbmm.default", "aten.convolution.default"}
_CHECK_LIMIT = 1 << 26  # bytes: larger operands are not allocated to ask torch for its message


def check_dtypes(program: Program) -> None:
    """A step real torch rejects (an int64 tensor into nn.Linear, float64 inputs into a float32 model) fails
    here, with torch's own message: the op is run for real, on empty tensors of its shapes and dtypes."""
    for op in program.ops:
        if op.target not in _SAME_DTYPE:
            continue
        refs: list[int] = []
        _real((*op.args, *(a for _, a in op.kwargs)), iter(()), refs)
        vals = [program.values[v] for v in refs]
        if len({v.dtype for v in vals}) <= 1:
            continue
        dtypes = ", ".join(f"{v.name} {str(v.dtype).removeprefix('torch.')}" for v in vals)
        msg = f"{op.target} got operands of different dtypes ({dtypes})"
        if sum(math.prod(v.shape) * v.dtype.itemsize for v in vals) <= _CHECK_LIMIT:
            it = iter(torch.empty(v.shape, dtype=v.dtype) for v in vals)
            try:
                op.overload(*_real(op.args, it), **{k: _real(a, it) for k, a in op.kwargs})
                continue  # torch accepts it
            except RuntimeError as e:
                msg = str(e).strip().splitlines()[0]
        raise CaptureError(
            f"torch rejects this step: {msg} (op {op.target} in module {op.module or '<root>'}"
            f"{f' ({op.source})' if op.source else ''}). Give the model inputs of the dtype its "
            "weights have (e.g. x.float() for integer data, or model.to(x.dtype)), or wrap the forward in "
            "torch.autocast")


def _real(a: Any, it, found: list[int] | None = None) -> Any:
    """`a` with each `Ref` replaced by the next tensor of `it` (or, with `found`, their value ids collected)."""
    if isinstance(a, Ref):
        if found is not None:
            found.append(a.id)
            return a
        return next(it)
    return type(a)(_real(x, it, found) for x in a) if isinstance(a, (list, tuple)) else a
