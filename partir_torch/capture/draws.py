"""One-element random draws a model branches on, made concrete for the capture.

LayerDrop (HF BART, mBART, Whisper, OPT, wav2vec2, ...) draws `torch.rand([])` in training mode and skips a
layer when the draw is below its drop probability: Python control flow on a tensor's value, which a
shapes-only trace cannot follow, even when the probability is 0 (the configs' default). Under `ScalarDraws`
such a draw is a known constant, its upper bound 1.0 (the draw is still made, unused, so the generator
advances as eager's does), so every comparison of the kind keeps the layer: the
captured step is the whole model, the one every step runs when the probability is 0. A draw compared with
a positive probability is reported (`skipping`): the engine then skips layers on some steps, which run a
program the plan did not cost and compile one of their own.

Random tensors are drawn in memory order. Eager dropout fills `empty_like(x)`, which keeps `x`'s layout
(`nn.TransformerEncoderLayer`'s dropout after attention reads a transposed [B, L, E]); functionalized, the
fill becomes `bernoulli.p`, whose result is row-major, and a rank or the simulator draws a whole tensor on
a fresh row-major one. `in_memory_order` makes the eager order explicit in the graph: such a draw is made
on its operand permuted to memory order and permuted back, so every engine draws the eager step's numbers.
Functionalization turns dropout's `empty_like(x)` into an expanded scalar, so no graph pass can see `x`'s
layout: `dropout` does the same before the trace (`capture/rewrites.py` calls it for `F.dropout`).
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from partir_torch import _compat
from partir_torch.capture.explain import user_frame

_COMPARE = {"lt", "le", "gt", "ge", "less", "less_equal", "greater", "greater_equal",
            "__lt__", "__le__", "__gt__", "__ge__"}  # (by name: `draw < p` arrives as TensorBase.lt)


def _size(args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    size = kwargs.get("size", args[0] if len(args) == 1 and not isinstance(args[0], int) else args)
    if isinstance(size, torch.Size | list | tuple) and all(isinstance(s, int) for s in size):
        return tuple(size)
    return None


class ScalarDraws(TorchFunctionMode):
    """`torch.rand` of one element returns the constant 1.0 (its dtype and shape kept) while the mode is on,
    the draw itself still made, so the dropout masks after it come from where eager's do; `skipping` lists
    (where, probability) for such draws compared with a positive number."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: dict[int, str] = {}  # id(draw) -> where it was drawn ("file:line")
        self.kept: list[torch.Tensor] = []  # (the draws themselves: their ids stay theirs)
        self.skipping: list[tuple[str, float]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rand and kwargs.get("out") is None:
            size = _size(args, kwargs)
            if size is not None and math.prod(size) == 1:
                func(*args, **kwargs)  # still drawn (unused): the step takes from the generator what eager takes
                dtype = kwargs.get("dtype") or torch.get_default_dtype()
                draw = torch.tensor(1.0, dtype=dtype).reshape(size)
                if kwargs.get("requires_grad"):
                    draw.requires_grad_()
                self.draws[id(draw)] = _caller()
                self.kept.append(draw)
                return draw
        if getattr(func, "__name__", None) in _COMPARE and len(args) == 2:
            a, b = args
            for t, other in ((a, b), (b, a)):
                if isinstance(t, torch.Tensor) and id(t) in self.draws and isinstance(other, int | float) \
                        and other > 0:
                    self.skipping.append((self.draws[id(t)], float(other)))
        return func(*args, **kwargs)


def _caller() -> str:
    """The user's line that drew (`explain.user_frame`)."""
    frame = user_frame(traceback.extract_stack())
    return f"{frame.filename}:{frame.lineno}" if frame is not None else "?"


aten = torch.ops.aten
# draws that fill a tensor laid out like their operand: `rand_like` & co. (preserve_format), and `bernoulli.p`
# on an `empty_like` (dropout's in-place fill, functionalized)
_LIKE = frozenset({aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
                   aten.randint_like.low_dtype, aten.bernoulli.p})


def _memory_order(t: Any) -> list[int] | None:
    """The dims of `t` from outermost to innermost in memory, where that is not row-major (else None)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or not _compat.is_non_overlapping_and_dense(t):
        return None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return None if order == list(range(t.dim())) else order


def dropout(input, p=0.5, training=True, inplace=False):  # (F.dropout's names)
    """`F.dropout` drawn in `input`'s memory order as eager draws it, on a row-major view of it (module
    docstring)."""
    order = _memory_order(input) if training and p and not inplace else None
    if order is None:
        return F.dropout(input, p, training, inplace)
    return F.dropout(input.permute(order), p, training).permute(sorted(range(len(order)), key=order.__getitem__))


def in_memory_order(gm: torch.fx.GraphModule) -> int:
    """Rewrite each draw whose eager result follows a non-row-major operand's layout into permute, draw,
    permute back (module docstring); how many were rewritten."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _LIKE or not node.args:
            continue
        x = node.args[0]
        if node.target is aten.bernoulli.p and not (isinstance(x, torch.fx.Node) and
                                                    x.target is aten.empty_like.default):
            continue  # (`torch.bernoulli(x, p)` itself: row-major in eager too)
        if node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            continue
        order = _memory_order(x.meta.get("val")) if isinstance(x, torch.fx.Node) else None
        if order is None:
            continue
        back = sorted(range(len(order)), key=order.__getitem__)
        val = node.meta["val"]
        with gm.graph.inserting_before(node):
            px = gm.graph.call_function(aten.permute.default, (x, order))
        with gm.graph.inserting_after(node):
            out = gm.graph.call_function(aten.permute.default, (node, back))
        node.replace_all_uses_with(out, delete_user_cb=lambda u, out=out: u is not out)
        node.args = (px, *node.args[1:])
        px.meta, out.meta = {**node.meta, "val": x.meta["val"].permute(order)}, {**node.meta, "val": val}
        node.meta["val"] = val.permute(order).contiguous()
        n += 1
    if n:
        gm.recompile()
    return n
