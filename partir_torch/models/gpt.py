"""GPT-2 / GPT-3 style decoder-only transformer (HF GPT-2 module names, ``nn.Linear`` instead of Conv1D)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ._common import attention, check_common, example_generator, randint, require


@dataclass(frozen=True)
class GPTConfig:
    """Shapes of :class:`GPT`. ``seq`` is both the block size (``wpe`` rows) and the example length."""

    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 1024
    batch: int = 8
    attn: str = "sdpa"
    tie: bool = True
    ln_eps: float = 1e-5
    dtype: str = "float32"
    qkv: str = "fused"  # fused: one c_attn as GPT-2; separate: q/k/v projections as OPT / GPT-J

    def __post_init__(self) -> None:
        check_common(self)
        require(self.qkv in ("fused", "separate"), f"qkv must be 'fused' or 'separate', got {self.qkv!r}")
        for name in ("layers", "width", "heads", "vocab", "seq", "batch"):
            require(getattr(self, name) > 0, f"{name} must be positive")
        require(self.width % self.heads == 0, f"width {self.width} not divisible by heads {self.heads}")


class CausalSelfAttention(nn.Module):
    """Fused-QKV causal attention (``c_attn`` -> heads -> ``c_proj``), as in GPT-2."""

    def __init__(self, width: int, heads: int, attn: str) -> None:
        super().__init__()
        self.heads = heads
        self.attn = attn
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=-1)
        q = q.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        y = attention(q, k, v, self.attn, causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, d))


class SeparateQKVAttention(nn.Module):
    """Causal attention with separate q/k/v projections (OPT, GPT-J): Megatron can tile each on its heads."""

    def __init__(self, width: int, heads: int, attn: str) -> None:
        super().__init__()
        self.heads = heads
        self.attn = attn
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = attention(q, k, v, self.attn, causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, d))


class GPTMLP(nn.Module):
    """``c_proj(gelu_tanh(c_fc(x)))`` with a 4x expansion."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPTBlock(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        attn = CausalSelfAttention if cfg.qkv == "fused" else SeparateQKVAttention
        self.attn = attn(cfg.width, cfg.heads, cfg.attn)
        self.ln_2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.mlp = GPTMLP(cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, ``h`` blocks, ``ln_f`` and an (optionally tied) LM head."""

    def __init__(self, cfg: GPTConfig, block: Callable[[Any], nn.Module] | None = None) -> None:
        super().__init__()
        block = block or GPTBlock  # the MoE transformer swaps in its own block
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq, cfg.width)
        self.h = nn.ModuleList(block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        # GPT-2 init scale for embeddings; N(0, 1) would make tied logits huge. Cheap on meta.
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        if cfg.tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(cfg: GPTConfig) -> GPT:
    return GPT(cfg)


def example_inputs(cfg: Any, device: torch.device) -> tuple[Tensor, ...]:
    """``(tokens, targets)``, both int64 ``[batch, seq]``."""
    gen = example_generator()
    shape = (cfg.batch, cfg.seq)
    return randint(cfg.vocab, shape, device, gen), randint(cfg.vocab, shape, device, gen)
