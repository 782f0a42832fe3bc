"""A sharded parameter's `.grad`: a stand-in that refuses every use, because the gradients live in the step.

On the torch backend the gradients are temporaries of the planned program (clipped there when asked:
`Options(max_grad_norm=...)`), so no real gradient is ever stored on a parameter. Left as None, a loop's
`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` would find no gradient and return 0 without
clipping anything. Each parameter's `.grad` is instead a `GradInStep`, a tensor of the gradient's shape and
dtype whose every operation raises with the way to do it; `zero_grad` (the optimizer's and the model's) puts
it back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from partir_torch import _compat
from partir_torch.errors import PartirError

HOW = ("a model sharded by partir_torch on torch.distributed has no gradients outside its planned step: they are "
       "made, clipped and applied inside `partir_torch.step`. Clip there with auto_shard(..., max_grad_norm=N) "
       "(or max_grad_value=V; Lightning: Trainer(gradient_clip_val=N)); read the loss from `partir_torch.step`")


class GradsInStep(PartirError, RuntimeError):
    """A gradient of a sharded parameter was read outside the step."""


class GradInStep(torch.Tensor):
    """The stand-in gradient (module docstring)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> GradInStep:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise GradsInStep(f"{func} on a gradient: {HOW}")

    __torch_function__ = _compat.get("disabled_torch_function_impl")

    def __repr__(self) -> str:  # (printing a parameter's grad is no error)
        return f"GradInStep({list(self.shape)}: made and applied inside partir_torch.step)"


def install(params: Iterable[torch.Tensor]) -> None:
    """Each trainable parameter's `.grad` the stand-in."""
    for p in params:
        if p.requires_grad and not isinstance(p.grad, GradInStep):
            p.grad = GradInStep(p)


class ZeroGrad:
    """A `zero_grad` for the model and its optimizer: the stand-ins stay (no real gradient to zero)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)

    def __call__(self, set_to_none: bool = True) -> None:
        install(self.params)
