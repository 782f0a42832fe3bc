"""Every rule family, proven on random shardings by the per-device simulator (hypothesis)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rules.harness import check

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))


class Lambda(nn.Module):
    def __init__(self, fn, **params) -> None:
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            self.register_parameter(k, nn.Parameter(v))

    def forward(self, *xs):
        return self.fn(self, *xs)


def r(*shape):
    return torch.randn(*shape)


@SETTINGS
@given(st.data())
def test_pointwise(data):
    m = Lambda(lambda s, x, y: torch.where(x > 0, F.gelu(x * s.w + y), torch.sigmoid(y) - x.exp().sqrt()) / (2 + s.b * s.b),
               w=r(8, 4), b=r(4))
    check(m, (r(8, 4), r(1, 4)), data)


@SETTINGS
@given(st.data())
def test_matrix(data):
    m = Lambda(lambda s, x, y: torch.bmm(F.linear(x, s.w, s.b), y), w=r(8, 4), b=r(8))
    check(m, (r(4, 8, 4), r(4, 8, 4)), data)


@SETTINGS
@given(st.data())
def test_reduction(data):
    m = Lambda(lambda s, x: (x * s.w).sum(1, keepdim=True) + x.mean(-1, keepdim=True) + x.cumsum(2), w=r(4, 8))
    check(m, (r(8, 4, 8),), data)


@SETTINGS
@given(st.data())
def test_view(data):
    def f(s, x):
        y = (x @ s.w).view(4, 8, 2, 4).transpose(1, 2).permute(0, 2, 1, 3).reshape(4, 8, 8)
        z = torch.cat([y, y[:, :, :4].unsqueeze(0).squeeze(0).expand(4, 8, 4)], dim=2)
        a, b = z.split(6, dim=2)
        return a.sum(-1) + b[:, :, 0] + z.select(2, 1) + z[:, :, :].sum(-1)
    check(Lambda(f, w=r(8, 8)), (r(4, 8, 8),), data)


@SETTINGS
@given(st.data())
def test_normalization(data):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.gn = nn.GroupNorm(2, 4)

        def forward(self, x, y):
            return F.softmax(self.ln(x), -1) + F.log_softmax(x, 1) + self.gn(y).mean((2, 3)).sum(-1, keepdim=True).unsqueeze(-1)
    check(M(), (r(4, 4, 8), r(4, 4, 2, 2)), data)


@SETTINGS
@given(st.data())
def test_attention(data):
    m = Lambda(lambda s, q, k: F.scaled_dot_product_attention(q * s.w, k, k, is_causal=True), w=r(8))
    check(m, (r(2, 4, 8, 8), r(2, 4, 8, 8)), data)


@SETTINGS
@given(st.data())
def test_indexing(data):
    idx = torch.tensor([0, 3, 1, 1, 2, 0, 3, 2])

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 8)

        def forward(self, x):
            e = self.emb(idx)  # [8, 8]
            g = x.index_select(0, idx)  # [8, 8]
            s = torch.zeros(4, 8).index_add(0, idx, g * e)
            up = F.interpolate(s.view(1, 4, 2, 4), scale_factor=2, mode="nearest")
            return s.sum() + up.sum(1) .sum() + e.sum(0)
    check(M(), (r(4, 8),), data)


@SETTINGS
@given(st.data())
def test_conv(data):
    m = nn.Conv2d(4, 8, 3, padding=1)
    check(m, (r(4, 4, 6, 6),), data)


@SETTINGS
@given(st.data())
def test_loss(data):
    target = torch.tensor([0, 3, 1, 2, 2, 1, 0, 3])

    def f(s, x, y):
        return F.cross_entropy(x @ s.w, target) + F.mse_loss(x, y)
    check(Lambda(f, w=r(8, 4)), (r(8, 8), r(8, 8)), data)
