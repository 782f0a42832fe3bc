"""The engine that holds a sharded model: one object per model, recorded when a backend shards it.

`auto_shard` records it; `step`, `unshard`, `verify` and the Lightning strategies ask it (`held_by(model)`)
instead of probing each backend's registry, so a model is never asked of an engine that does not hold it,
and a third engine is one more `Engine`.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
import torch.nn as nn


class Engine(Protocol):
    """What the facade asks of the engine holding a sharded model."""

    name: str  # "torch" | "xla"

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor, local: bool = False,
             accumulate: int | None = None) -> torch.Tensor: ...

    def unshard(self, model: nn.Module) -> nn.Module: ...

    def verify(self, model: nn.Module, example_inputs: Any, **kwargs: Any) -> Any: ...

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers whole, on the CPU (checkpoints any process can load)."""
        ...

    def load(self, model: nn.Module, path: Any, *, strict: bool = True) -> Any:
        """Pretrained weights (safetensors, DCP) into the sharded model, each rank reading its part."""
        ...


_HELD: weakref.WeakKeyDictionary[nn.Module, Engine] = weakref.WeakKeyDictionary()


def hold(model: nn.Module, engine: Engine) -> None:
    _HELD[model] = engine


def release(model: nn.Module) -> None:
    _HELD.pop(model, None)


def held_by(model: nn.Module) -> Engine | None:
    """The engine holding `model` (None: not sharded)."""
    return _HELD.get(model)
