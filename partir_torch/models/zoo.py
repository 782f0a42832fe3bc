"""Registry of named model configurations: ``names()``, ``config()``, ``build()``.

Every entry is a frozen config dataclass plus module-level (hence picklable) builder, example-input
and loss functions. ``build`` constructs the model under a ``torch.device`` context so that on meta
even 70B-parameter shapes are created instantly without allocating memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import gns, gpt, llama, mlp, moe, unet, vit
from ._common import apply_overrides, classification_loss, lm_loss, regression_loss, resolve_dtype

LossFn = Callable[..., Tensor]


@dataclass(frozen=True)
class ZooEntry:
    """One named model: default config and how to build it, its example inputs and its loss."""

    name: str
    config: Any
    build_model: Callable[[Any], nn.Module]
    example_inputs: Callable[[Any, torch.device], tuple[Tensor, ...]]
    loss_fn: LossFn
    description: str


_ZOO: dict[str, ZooEntry] = {}


def _register(name: str, cfg: Any, module: Any, loss_fn: LossFn, description: str) -> None:
    _ZOO[name] = ZooEntry(name, cfg, module.build_model, module.example_inputs, loss_fn, description)


_register("mlp", mlp.MLPConfig(), mlp, regression_loss, "4 residual MLP blocks 1024->4096->1024, MSE")
_register(
    "tiny-mlp",
    mlp.MLPConfig(batch=8, width=16, hidden=32, layers=2, out=16),
    mlp,
    regression_loss,
    "tiny MLP",
)

_register("gpt2-small", gpt.GPTConfig(), gpt, lm_loss, "GPT-2 small, 124M (tied)")
_register("gpt2-medium", gpt.GPTConfig(layers=24, width=1024, heads=16), gpt, lm_loss, "GPT-2 medium, 355M")
_register("gpt2-xl", gpt.GPTConfig(layers=48, width=1600, heads=25), gpt, lm_loss, "GPT-2 XL, 1.56B")
_register(
    "gpt-6.7b", gpt.GPTConfig(layers=32, width=4096, heads=32, seq=2048, qkv="separate"), gpt, lm_loss,
    "GPT-3 6.7B shape, separate q/k/v projections (as OPT-6.7B)"
)
_register(
    "tiny-gpt2",
    gpt.GPTConfig(layers=2, width=32, heads=4, vocab=128, seq=16, batch=4),
    gpt,
    lm_loss,
    "tiny GPT-2",
)

_register("llama-7b", llama.LlamaConfig(), llama, lm_loss, "Llama-2 7B shape")
_register(
    "llama-13b",
    llama.LlamaConfig(layers=40, width=5120, heads=40, kv_heads=40, ffn=13824),
    llama,
    lm_loss,
    "Llama-2 13B shape",
)
_register(
    "llama-70b",
    llama.LlamaConfig(layers=80, width=8192, heads=64, kv_heads=8, ffn=28672),
    llama,
    lm_loss,
    "Llama-2 70B shape (GQA, 8 KV heads)",
)
# Frontier shapes as trained (issue [scale]): PyTorch AMP (fp32 master weights, gradients and Adam states, bf16
# matmuls and activations), published sequence lengths, a global batch the scenarios' batch-parallel axes divide
# (benchmarks/scale.py: 256 = data 16 x fsdp 16; 1024 = pod 4 x data 16 x fsdp 16; 16 on data 8)
_register(
    "llama2-70b",
    llama.LlamaConfig(layers=80, width=8192, heads=64, kv_heads=8, ffn=28672, seq=4096, batch=256, amp=True),
    llama,
    lm_loss,
    "Llama-2 70B as trained: GQA 64/8, seq 4096, global batch 256, bf16 autocast over fp32 master weights",
)
_register(
    "llama3-8b",
    llama.LlamaConfig(layers=32, width=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192, batch=16,
                      rope_theta=500000.0, amp=True),
    llama,
    lm_loss,
    "Llama-3 8B as trained: GQA 32/8, vocab 128256, seq 8192, global batch 16, bf16 autocast",
)
_register(
    "llama3-405b",
    llama.LlamaConfig(layers=126, width=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=8192, batch=1024,
                      rope_theta=500000.0, amp=True),
    llama,
    lm_loss,
    "Llama-3 405B as trained: 126 layers, GQA 128/8, seq 8192, global batch 1024, bf16 autocast",
)
_register(
    "tiny-llama",
    llama.LlamaConfig(layers=2, width=32, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16, batch=2),
    llama,
    lm_loss,
    "tiny Llama with GQA",
)

_register("unet", unet.UNetConfig(), unet, unet.unet_loss, "diffusion U-Net, ~480M params, 64x64")
_register(
    "tiny-unet",
    unet.UNetConfig(batch=2, image=16, base=8, mults="1,2", blocks_per_level=1, groups=4),
    unet,
    unet.unet_loss,
    "tiny U-Net",
)

_register("gns", gns.GNSConfig(), gns, gns.gns_loss, "graph network simulator, 64K nodes / 1M edges")
_register("tiny-gns", gns.GNSConfig(nodes=16, edges=48, latent=16, steps=2), gns, gns.gns_loss, "tiny GNS")

_register("moe", moe.MoEConfig(), moe, lm_loss, "12-layer top-2 MoE transformer, 8 experts")
_register(
    "tiny-moe",
    moe.MoEConfig(layers=2, width=32, heads=4, experts=4, topk=2, ffn=64, vocab=128, seq=16, batch=2),
    moe,
    lm_loss,
    "tiny MoE",
)

_register("vit-base", vit.ViTConfig(), vit, classification_loss, "ViT-B/16, 224x224, 1000 classes")
_register(
    "tiny-vit",
    vit.ViTConfig(image=32, patch=8, layers=2, width=32, heads=4, mlp=128, classes=10, batch=2),
    vit,
    classification_loss,
    "tiny ViT",
)


def names() -> list[str]:
    """All registered model names, in registration order."""
    return list(_ZOO)


def _entry(name: str) -> ZooEntry:
    try:
        return _ZOO[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(_ZOO)}") from None


def describe(name: str) -> str:
    """One-line human description of a zoo model."""
    return _entry(name).description


def config(name: str, overrides: Mapping[str, object] | None = None) -> Any:
    """The (frozen) config of ``name`` with ``overrides`` (strings parsed to field types) applied."""
    return apply_overrides(_entry(name).config, overrides, model=name)


def build(
    name: str, overrides: Mapping[str, object] | None = None, *, device: str | torch.device = "meta"
) -> tuple[nn.Module, tuple[Tensor, ...], LossFn]:
    """Build ``(model, example_inputs, loss_fn)``; ``loss_fn(model, *example_inputs)`` is a scalar.

    The model and inputs live on ``device`` (meta by default: shapes only, no memory); the model is
    cast to the config's dtype, as are float inputs. Integer inputs are valid indices on real devices.
    """
    entry = _entry(name)
    cfg = apply_overrides(entry.config, overrides, model=name)
    dev = torch.device(device)
    with dev:
        model = entry.build_model(cfg)
    model.to(dtype=resolve_dtype(cfg.dtype))
    return model, entry.example_inputs(cfg, dev), entry.loss_fn
