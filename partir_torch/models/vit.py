"""Vision Transformer (ViT-B/16 by default): conv patch embedding, cls token, pre-LN encoder, linear head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._common import attention, check_common, example_generator, randint, randn, require, resolve_dtype


@dataclass(frozen=True)
class ViTConfig:
    """Shapes of :class:`ViT`; ``mlp`` is the hidden size of each block's MLP."""

    image: int = 224
    patch: int = 16
    in_ch: int = 3
    layers: int = 12
    width: int = 768
    heads: int = 12
    mlp: int = 3072
    classes: int = 1000
    batch: int = 32
    attn: str = "sdpa"
    ln_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_common(self)
        for name in ("image", "patch", "in_ch", "layers", "width", "heads", "mlp", "classes", "batch"):
            require(getattr(self, name) > 0, f"{name} must be positive")
        require(self.image % self.patch == 0, f"image {self.image} not divisible by patch {self.patch}")
        require(self.width % self.heads == 0, f"width {self.width} not divisible by heads {self.heads}")


class ViTAttention(nn.Module):
    """Bidirectional fused-QKV attention."""

    def __init__(self, width: int, heads: int, attn: str) -> None:
        super().__init__()
        self.heads = heads
        self.attn = attn
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = attention(qkv[0], qkv[1], qkv[2], self.attn, causal=False)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class ViTMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTBlock(nn.Module):
    """Pre-LN encoder block."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.attn = ViTAttention(cfg.width, cfg.heads, cfg.attn)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.mlp = ViTMLP(cfg.width, cfg.mlp)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Classifies from the final cls-token state."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        patches = (cfg.image // cfg.patch) ** 2
        self.patch_embed = nn.Conv2d(cfg.in_ch, cfg.width, cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.pos_embed = nn.Parameter(torch.empty(1, patches + 1, cfg.width))
        nn.init.normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.width, cfg.classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [b, patches, width]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def build_model(cfg: ViTConfig) -> ViT:
    return ViT(cfg)


def example_inputs(cfg: ViTConfig, device: torch.device) -> tuple[Tensor, ...]:
    """``(images [batch, in_ch, image, image], labels [batch] int64)``."""
    gen = example_generator()
    images = randn((cfg.batch, cfg.in_ch, cfg.image, cfg.image), resolve_dtype(cfg.dtype), device, gen)
    return images, randint(cfg.classes, (cfg.batch,), device, gen)
