"""One-element random draws a model branches on, made concrete for the capture.

LayerDrop (HF BART, mBART, Whisper, OPT, wav2vec2, ...) draws `torch.rand([])` in training mode and skips a
layer when the draw is below its drop probability: Python control flow on a tensor's value, which a
shapes-only trace cannot follow, even when the probability is 0 (the configs' default). Under `ScalarDraws`
such a draw is a known constant, its upper bound 1.0, so every comparison of the kind keeps the layer: the
captured step is the whole model, the one every step runs when the probability is 0. A draw compared with
a positive probability is reported (`skipping`): the engine then skips layers on some steps, which run a
program the plan did not cost and compile one of their own.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from partir_torch.capture.explain import user_frame

_COMPARE = {"lt", "le", "gt", "ge", "less", "less_equal", "greater", "greater_equal",
            "__lt__", "__le__", "__gt__", "__ge__"}  # (by name: `draw < p` arrives as TensorBase.lt)


def _size(args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    size = kwargs.get("size", args[0] if len(args) == 1 and not isinstance(args[0], int) else args)
    if isinstance(size, torch.Size | list | tuple) and all(isinstance(s, int) for s in size):
        return tuple(size)
    return None


class ScalarDraws(TorchFunctionMode):
    """`torch.rand` of one element returns the constant 1.0 (its dtype and shape kept) while the mode is
    on; `skipping` lists (where, probability) for such draws compared with a positive number."""

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
