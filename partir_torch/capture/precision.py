"""Every floating-point dtype a model asks for read as float64, for the simulator's float64 re-run.

The simulator tells rounding from a wrong plan by running the step again in float64 against a 1e-9 bar
(`simulate.simulate_fp64`). `model.double()` converts parameters and buffers, but a model's own casts stay:
Llama's RMSNorm computes in `x.float()`, a bf16 model casts back with `.to(torch.bfloat16)`, a loss takes
`logits.float()`, a rotary table is built with `dtype=torch.float32`. Left in, they round the "float64" step
to float32 or bfloat16 and the verdict reads that rounding as a wrong plan. Under `AllFloat64` each of those
asks for float64 instead, so the re-run is float64 from the first op to the last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}  # x.float(): no dtype to rewrite


def _wide(a: Any) -> Any:
    if isinstance(a, torch.dtype) and a.is_floating_point and a != torch.float64:
        return torch.float64
    if isinstance(a, str) and a in ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"):
        return "torch.DoubleTensor"  # x.type("torch.FloatTensor")
    return a


class AllFloat64(TorchFunctionMode):
    """While on: a torch call's floating dtype argument (`.to(torch.float32)`, `dtype=torch.bfloat16`, ...) and
    the casts `.float()` / `.half()` / `.bfloat16()` give float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS:
            return torch.Tensor.double(args[0])
        return func(*(_wide(a) for a in args), **{k: _wide(v) for k, v in kwargs.items()})


@contextlib.contextmanager
def all_float64() -> Iterator[None]:
    """`AllFloat64`, with float64 as the default dtype (factories without a dtype: `torch.ones(n)`)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with AllFloat64():
            yield
    finally:
        torch.set_default_dtype(old)
