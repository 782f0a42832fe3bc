"""Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, untied head."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._common import attention, check_common, example_generator, randint, require


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of :class:`Llama`. ``seq`` is also the rotary table length (max positions)."""

    layers: int = 32
    width: int = 4096
    heads: int = 32
    kv_heads: int = 32
    ffn: int = 11008
    vocab: int = 32000
    seq: int = 2048
    batch: int = 4
    attn: str = "sdpa"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dtype: str = "float32"
    amp: bool = False  # mixed precision as large models are trained (FSDP's bf16 parameter dtype over fp32 master
    # weights): fp32 parameters, gradients and Adam states; the forward under torch.autocast(bf16), the residual
    # stream and every activation and activation gradient in bf16 (RMSNorm's statistics in fp32)

    def __post_init__(self) -> None:
        check_common(self)
        for name in ("layers", "width", "heads", "kv_heads", "ffn", "vocab", "seq", "batch"):
            require(getattr(self, name) > 0, f"{name} must be positive")
        require(self.width % self.heads == 0, f"width {self.width} not divisible by heads {self.heads}")
        require((self.width // self.heads) % 2 == 0, "head_dim must be even for rotary embeddings")
        require(
            self.heads % self.kv_heads == 0, f"heads {self.heads} not divisible by kv_heads {self.kv_heads}"
        )
        require(not (self.amp and self.dtype != "float32"),
                f"amp keeps float32 parameters (master weights) and runs the forward in bf16; got dtype {self.dtype}")


class RMSNorm(nn.Module):
    """``weight * x * rsqrt(mean(x^2) + eps)``, computed in fp32 so bf16 models stay stable."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)  # bf16 under amp (a no-op otherwise)


class RotaryEmbedding(nn.Module):
    """Precomputed ``cos``/``sin`` tables ``[max_seq, head_dim]`` as non-persistent buffers.

    One table for the whole model (not per layer): the layers stay identical and the constant is
    stored once. Buffers (not plain attributes) so ``.to()``, meta construction and
    reparametrization all see them.
    """

    def __init__(self, head_dim: int, max_seq: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, seq: int) -> tuple[Tensor, Tensor]:
        return self.cos[:seq], self.sin[:seq]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by position (rotate-half formulation)."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention: ``kv_heads`` K/V heads are expanded to ``heads`` before attention."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.width // cfg.heads
        self.attn = cfg.attn
        self.q_proj = nn.Linear(cfg.width, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.width, bias=False)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """``[b, kv, s, hd] -> [b, heads, s, hd]`` by expand+reshape (each KV head serves a group)."""
        if self.kv_heads == self.heads:
            return x
        b, kv, s, hd = x.shape
        rep = self.heads // kv
        return x[:, :, None].expand(b, kv, rep, s, hd).reshape(b, kv * rep, s, hd)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        y = attention(q, self._repeat_kv(k), self._repeat_kv(v), self.attn, causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, ffn, bias=False)
        self.up_proj = nn.Linear(width, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, width, bias=False)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: attention and SwiGLU, each with a residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.width, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.width, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg.width, cfg.ffn)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm`` -> ``lm_head`` (untied)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.rotary = RotaryEmbedding(cfg.width // cfg.heads, cfg.seq, cfg.rope_theta)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.amp = cfg.amp
        nn.init.normal_(self.embed_tokens.weight, std=0.02)  # Llama init scale; cheap on meta.

    def forward(self, tokens: Tensor) -> Tensor:
        amp = torch.autocast(tokens.device.type, dtype=torch.bfloat16) if self.amp else contextlib.nullcontext()
        with amp:
            cos, sin = self.rotary(tokens.shape[1])
            x = self.embed_tokens(tokens)
            if self.amp:  # the residual stream in bf16 too, as FSDP's bf16 parameter dtype runs it
                x = x.to(torch.bfloat16)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x))


def build_model(cfg: LlamaConfig) -> Llama:
    return Llama(cfg)


def example_inputs(cfg: LlamaConfig, device: torch.device) -> tuple[Tensor, ...]:
    """``(tokens, targets)``, both int64 ``[batch, seq]``."""
    gen = example_generator()
    shape = (cfg.batch, cfg.seq)
    return randint(cfg.vocab, shape, device, gen), randint(cfg.vocab, shape, device, gen)
