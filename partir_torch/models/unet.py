"""Diffusion-style U-Net (DDPM / Stable-Diffusion layout without attention) with a timestep embedding."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import check_common, example_generator, randint, randn, require, resolve_dtype

TIMESTEPS = 1000  # range of the example timestep input


def parse_mults(mults: str) -> tuple[int, ...]:
    """``"1,2,4,4"`` -> ``(1, 2, 4, 4)``; a string so it can come from a CLI override."""
    try:
        out = tuple(int(m) for m in mults.replace(" ", "").split(",") if m)
    except ValueError:
        raise ValueError(f"mults must be comma-separated ints, got {mults!r}") from None
    require(len(out) > 0 and all(m > 0 for m in out), f"mults must be positive ints, got {mults!r}")
    return out


@dataclass(frozen=True)
class UNetConfig:
    """Shapes of :class:`UNet`. Channels at level ``i`` are ``base * mults[i]``; all divisible by ``groups``."""

    batch: int = 8
    image: int = 64
    in_ch: int = 3
    base: int = 288  # default "unet": 479,761,347 params (base 256 -> 379M, 320 -> 592M)
    mults: str = "1,2,4,4"
    blocks_per_level: int = 2
    groups: int = 32
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_common(self)
        for name in ("batch", "image", "in_ch", "base", "blocks_per_level", "groups"):
            require(getattr(self, name) > 0, f"{name} must be positive")
        levels = parse_mults(self.mults)
        require(self.base % 2 == 0, "base must be even (sinusoidal timestep embedding)")
        for m in levels:
            require((self.base * m) % self.groups == 0, f"channels {self.base * m} not divisible by groups")
        factor = 2 ** (len(levels) - 1)
        require(
            self.image % factor == 0, f"image {self.image} not divisible by {factor} ({len(levels)} levels)"
        )


class ResBlock(nn.Module):
    """GroupNorm-SiLU-Conv twice, timestep embedding added in between, 1x1 skip if channels change."""

    def __init__(self, in_ch: int, out_ch: int, emb_dim: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.emb_proj = nn.Linear(emb_dim, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.act = nn.SiLU()
        self.skip: nn.Module = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(self.act(self.norm1(x)))
        h = h + self.emb_proj(self.act(emb))[:, :, None, None]
        h = self.conv2(self.act(self.norm2(h)))
        return self.skip(x) + h


class Downsample(nn.Module):
    """Stride-2 3x3 conv halving the resolution."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour x2 then a 3x3 conv (avoids transposed-conv checkerboards)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class DownLevel(nn.Module):
    """ResBlocks at one resolution, then (except at the bottom) a downsample."""

    def __init__(self, blocks: list[ResBlock], down: Downsample | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.downsample = down


class UpLevel(nn.Module):
    """ResBlocks consuming skip connections, then (except at the top) an upsample."""

    def __init__(self, blocks: list[ResBlock], up: Upsample | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.upsample = up


class MiddleBlock(nn.Module):
    """Two ResBlocks at the lowest resolution."""

    def __init__(self, ch: int, emb_dim: int, groups: int) -> None:
        super().__init__()
        self.block1 = ResBlock(ch, ch, emb_dim, groups)
        self.block2 = ResBlock(ch, ch, emb_dim, groups)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        return self.block2(self.block1(x, emb), emb)


class UNet(nn.Module):
    """Predicts noise (same shape as the image) from an image and an integer timestep."""

    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        mults = parse_mults(cfg.mults)
        self.base = cfg.base
        emb_dim = 4 * cfg.base
        self.time_embed = nn.Sequential(nn.Linear(cfg.base, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        self.conv_in = nn.Conv2d(cfg.in_ch, cfg.base, 3, padding=1)

        ch = cfg.base
        skip_chs = [ch]
        self.down = nn.ModuleList()
        for i, m in enumerate(mults):
            blocks = []
            for _ in range(cfg.blocks_per_level):
                blocks.append(ResBlock(ch, cfg.base * m, emb_dim, cfg.groups))
                ch = cfg.base * m
                skip_chs.append(ch)
            down = None
            if i < len(mults) - 1:
                down = Downsample(ch)
                skip_chs.append(ch)
            self.down.append(DownLevel(blocks, down))

        self.mid = MiddleBlock(ch, emb_dim, cfg.groups)

        self.up = nn.ModuleList()
        for i, m in reversed(list(enumerate(mults))):
            blocks = []
            for _ in range(cfg.blocks_per_level + 1):
                blocks.append(ResBlock(ch + skip_chs.pop(), cfg.base * m, emb_dim, cfg.groups))
                ch = cfg.base * m
            self.up.append(UpLevel(blocks, Upsample(ch) if i > 0 else None))

        self.norm_out = nn.GroupNorm(cfg.groups, ch)
        self.act_out = nn.SiLU()
        self.conv_out = nn.Conv2d(ch, cfg.in_ch, 3, padding=1)

    def timestep_embedding(self, t: Tensor) -> Tensor:
        """Sinusoidal features of ``t``; frequencies come from ``arange`` on ``t``'s device."""
        half = self.base // 2
        freqs = torch.exp(
            torch.arange(half, device=t.device, dtype=torch.float32) * (-math.log(10000.0) / half)
        )
        args = t.float()[:, None] * freqs[None, :]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return emb.to(self.conv_in.weight.dtype)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        emb = self.time_embed(self.timestep_embedding(t))
        h = self.conv_in(x)
        skips = [h]
        for level in self.down:
            for block in level.blocks:
                h = block(h, emb)
                skips.append(h)
            if level.downsample is not None:
                h = level.downsample(h)
                skips.append(h)
        h = self.mid(h, emb)
        for level in self.up:
            for block in level.blocks:
                h = block(torch.cat([h, skips.pop()], dim=1), emb)
            if level.upsample is not None:
                h = level.upsample(h)
        return self.conv_out(self.act_out(self.norm_out(h)))


def build_model(cfg: UNetConfig) -> UNet:
    return UNet(cfg)


def example_inputs(cfg: UNetConfig, device: torch.device) -> tuple[Tensor, ...]:
    """``(noisy_image, timestep, target_noise)``; images ``[batch, in_ch, image, image]``, timestep int64."""
    gen = example_generator()
    dtype = resolve_dtype(cfg.dtype)
    shape = (cfg.batch, cfg.in_ch, cfg.image, cfg.image)
    return (
        randn(shape, dtype, device, gen),
        randint(TIMESTEPS, (cfg.batch,), device, gen),
        randn(shape, dtype, device, gen),
    )


def unet_loss(model: nn.Module, x: Tensor, t: Tensor, target: Tensor) -> Tensor:
    """Denoising MSE: predicted noise vs the target noise."""
    return F.mse_loss(model(x, t).float(), target.float())
