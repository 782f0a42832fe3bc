"""Mixture-of-experts transformer: GPT blocks whose MLP is a top-k routed MoE with static capacity.

Routing follows GShard/Switch with dense dispatch/combine tensors, so every shape is static and no
value ever leaves the device (no ``.item()``, no boolean indexing): ideal for whole-step capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._common import check_common, require
from .gpt import GPT, CausalSelfAttention
from .gpt import example_inputs as gpt_example_inputs


@dataclass(frozen=True)
class MoEConfig:
    """Shapes of :class:`MoETransformer`; ``ffn`` is the hidden size of each expert."""

    layers: int = 12
    width: int = 1024
    heads: int = 16
    experts: int = 8
    topk: int = 2
    ffn: int = 4096
    vocab: int = 32000
    seq: int = 1024
    batch: int = 8
    capacity_factor: float = 1.25
    attn: str = "sdpa"
    tie: bool = True
    ln_eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_common(self)
        for name in ("layers", "width", "heads", "experts", "topk", "ffn", "vocab", "seq", "batch"):
            require(getattr(self, name) > 0, f"{name} must be positive")
        require(self.width % self.heads == 0, f"width {self.width} not divisible by heads {self.heads}")
        require(self.topk <= self.experts, f"topk {self.topk} exceeds experts {self.experts}")
        require(self.capacity_factor > 0, "capacity_factor must be positive")


def expert_capacity(tokens: int, experts: int, topk: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(k * tokens * factor / experts)``, at most ``tokens`` (a token visits an
    expert at most once). Plain Python ints: shapes are static under tracing."""
    return max(1, min(tokens, math.ceil(topk * tokens * capacity_factor / experts)))


class MoELayer(nn.Module):
    """Router + ``experts`` GELU MLPs stored as stacked ``[E, ...]`` parameters (expert-parallel friendly)."""

    def __init__(self, width: int, ffn: int, experts: int, topk: int, capacity_factor: float) -> None:
        super().__init__()
        self.experts = experts
        self.topk = topk
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(width, experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(experts, width, ffn))
        self.w_out = nn.Parameter(torch.empty(experts, ffn, width))
        self.act = nn.GELU(approximate="tanh")
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02)

    def routing(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Dense ``(dispatch, combine)``, both ``[tokens, experts, capacity]``.

        Slots are assigned with a cumsum over (choice rank, token) so all first choices are placed
        before any second choice; tokens past capacity are dropped (their slot one-hot is empty).
        """
        tokens, e, k = x.shape[0], self.experts, self.topk
        cap = expert_capacity(tokens, e, k, self.capacity_factor)
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        gates, idx = torch.topk(probs, k, dim=-1)  # [T, k]
        gates = gates / gates.sum(dim=-1, keepdim=True)
        # one-hot via comparison with arange (F.one_hot validates index values, i.e. reads data).
        chosen = (idx.t().unsqueeze(-1) == torch.arange(e, device=x.device)).long()  # [k, T, E]
        flat = chosen.reshape(k * tokens, e)
        pos = torch.cumsum(flat, dim=0) * flat - 1  # slot index, -1 where not chosen
        slots = pos.unsqueeze(-1) == torch.arange(cap, device=x.device)  # [kT, E, C]; overflow -> empty
        slots = slots.view(k, tokens, e, cap).to(probs.dtype)
        combine = (slots * gates.t()[:, :, None, None]).sum(dim=0)
        dispatch = slots.sum(dim=0)
        return dispatch.to(x.dtype), combine.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        dispatch, combine = self.routing(flat)
        expert_in = torch.einsum("tec,td->ecd", dispatch, flat)
        hidden = self.act(torch.bmm(expert_in, self.w_in))
        expert_out = torch.bmm(hidden, self.w_out)
        return torch.einsum("tec,ecd->td", combine, expert_out).view(b, s, d)


class MoEBlock(nn.Module):
    """Pre-LN block: causal attention then the MoE layer, each with a residual."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.attn = CausalSelfAttention(cfg.width, cfg.heads, cfg.attn)
        self.ln_2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.moe = MoELayer(cfg.width, cfg.ffn, cfg.experts, cfg.topk, cfg.capacity_factor)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class MoETransformer(GPT):
    """GPT-style LM (``wte``, ``wpe``, ``h``, ``ln_f``, ``lm_head``) with MoE blocks."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg, MoEBlock)


def build_model(cfg: MoEConfig) -> MoETransformer:
    return MoETransformer(cfg)


example_inputs = gpt_example_inputs  # (tokens, targets), both int64 [batch, seq]
