"""Model zoo: named, capture-friendly training workloads (model, example inputs, loss function).

Each model is a plain ``nn.Module`` with static shapes and no data-dependent control flow, so a whole
training step can be traced with ``make_fx`` on fake tensors. Repeated layers live in
``nn.ModuleList`` containers so they are structurally identical siblings.
"""

from __future__ import annotations

from .gns import GNSConfig
from .gpt import GPTConfig
from .llama import LlamaConfig
from .mlp import MLPConfig
from .moe import MoEConfig
from .unet import UNetConfig
from .vit import ViTConfig
from .zoo import ZooEntry, build, config, describe, names

__all__ = [
    "GNSConfig",
    "GPTConfig",
    "LlamaConfig",
    "MLPConfig",
    "MoEConfig",
    "UNetConfig",
    "ViTConfig",
    "ZooEntry",
    "build",
    "config",
    "describe",
    "names",
]
