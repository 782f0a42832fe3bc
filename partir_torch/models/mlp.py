"""A residual stack of MLP blocks: the simplest model with Megatron-style shardable layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._common import check_common, example_generator, randn, require, resolve_dtype


@dataclass(frozen=True)
class MLPConfig:
    """Shapes of :class:`MLP`; input ``x`` is ``[batch, width]``, target ``[batch, out]``."""

    batch: int = 64
    width: int = 1024
    hidden: int = 4096
    layers: int = 4
    out: int = 1024
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_common(self)
        for name in ("batch", "width", "hidden", "layers", "out"):
            require(getattr(self, name) > 0, f"{name} must be positive")


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: the up/down pair is the classic column/row-parallel unit."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class MLP(nn.Module):
    """``layers`` identical :class:`MLPBlock` siblings followed by a linear head."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(cfg.width, cfg.hidden) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.width, cfg.out)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model(cfg: MLPConfig) -> MLP:
    return MLP(cfg)


def example_inputs(cfg: MLPConfig, device: torch.device) -> tuple[Tensor, ...]:
    """``(x, target)``."""
    gen = example_generator()
    dtype = resolve_dtype(cfg.dtype)
    return randn((cfg.batch, cfg.width), dtype, device, gen), randn((cfg.batch, cfg.out), dtype, device, gen)
