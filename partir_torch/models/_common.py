"""Shared helpers for the model zoo: dtype names, override parsing, example inputs, attention, losses.

Everything here must stay friendly to ``make_fx`` on fake tensors: no data-dependent control flow,
static shapes only, and internal tensors created on the device of the inputs.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}

ATTN_IMPLS = ("sdpa", "math")

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


def resolve_dtype(name: str) -> torch.dtype:
    """Map a config dtype string (``"float32"``, ``"bfloat16"``, ...) to a ``torch.dtype``."""
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(sorted(_DTYPES))}") from None


def require(cond: bool, message: str) -> None:
    """Config validation helper: raise ``ValueError`` (not assert, which ``-O`` strips)."""
    if not cond:
        raise ValueError(message)


def check_common(cfg: Any) -> None:
    """Validations shared by every config: a known dtype and, where present, a known attention impl."""
    resolve_dtype(cfg.dtype)
    attn = getattr(cfg, "attn", None)
    if attn is not None:
        require(attn in ATTN_IMPLS, f"attn must be one of {ATTN_IMPLS}, got {attn!r}")


def _parse_value(key: str, raw: object, typ: Any) -> object:
    """Convert one override (usually a CLI string) to the dataclass field's declared type."""
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"override {key}={raw!r}: expected a bool (true/false/1/0)")
    if typ is int:
        if isinstance(raw, bool):
            raise ValueError(f"override {key}={raw!r}: expected an int")
        if isinstance(raw, int):
            return raw
        try:
            return int(str(raw).strip())
        except ValueError:
            raise ValueError(f"override {key}={raw!r}: expected an int") from None
    if typ is float:
        try:
            return float(str(raw).strip())
        except ValueError:
            raise ValueError(f"override {key}={raw!r}: expected a float") from None
    if typ is str:
        return str(raw)
    raise TypeError(f"config field {key!r} has unsupported type {typ!r}")


def apply_overrides(cfg: Any, overrides: Mapping[str, object] | None, *, model: str) -> Any:
    """Return ``cfg`` with ``overrides`` applied, each parsed to its field's type.

    Unknown keys raise ``ValueError`` naming the key and listing the valid ones, so a CLI typo is
    reported instead of silently ignored. Field validation (``__post_init__``) runs on the result.
    """
    if not overrides:
        return cfg
    hints = typing.get_type_hints(type(cfg))
    valid = [f.name for f in dataclasses.fields(cfg)]
    parsed: dict[str, object] = {}
    for key, raw in overrides.items():
        if key not in valid:
            raise ValueError(
                f"unknown override key {key!r} for model {model!r}; valid keys: {', '.join(valid)}"
            )
        parsed[key] = _parse_value(key, raw, hints[key])
    return dataclasses.replace(cfg, **parsed)


def example_generator(seed: int = 0) -> torch.Generator:
    """A CPU generator so real (non-meta) example inputs are reproducible across builds."""
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Tensor:
    """Float example input; on meta only the shape exists, so skip generating data."""
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def randint(high: int, shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> Tensor:
    """Integer (int64) example input in ``[0, high)``, valid as indices in real runs."""
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.int64, device=device)
    return torch.randint(0, high, shape, generator=gen, dtype=torch.int64).to(device)


def attention(q: Tensor, k: Tensor, v: Tensor, impl: str, *, causal: bool) -> Tensor:
    """Multi-head attention on ``[batch, heads, seq, head_dim]`` tensors.

    ``"sdpa"`` is the fused PyTorch op; ``"math"`` spells the same computation out with matmuls so a
    partitioner sees the individual ops. The causal mask is built from ``arange`` on the input's
    device (static shape) rather than stored, so it never pins a device or costs a buffer.
    """
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        s_q, s_k = scores.shape[-2], scores.shape[-1]
        rows = torch.arange(s_q, device=q.device).unsqueeze(1)
        cols = torch.arange(s_k, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy; logits go to fp32 first so low-precision models get a stable loss."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def classification_loss(model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
    """Cross entropy of class logits against integer labels."""
    return F.cross_entropy(model(images).float(), labels)


def regression_loss(model: nn.Module, x: Tensor, target: Tensor) -> Tensor:
    """Mean squared error of the model output against a float target."""
    return F.mse_loss(model(x).float(), target.float())
