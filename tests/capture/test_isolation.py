"""The capture leaves nothing of its fake tensors in the user's model (`capture/isolation.py`)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from partir_torch.capture import capture
from partir_torch.capture.isolation import ModelState


class Cached(nn.Module):
    """Caches a tensor per size in an `lru_cache` on a method (as HF BEiT does its relative-position index)
    and keeps the last mask as an attribute (as rotary and mask caches do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.seen = None

    @functools.lru_cache(maxsize=4)  # noqa: B019 (the pattern under test)
    def index(self, n: int) -> torch.Tensor:
        return torch.arange(n).flip(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = torch.ones(x.shape[-1])
        return self.lin(x)[:, self.index(x.shape[-1])] * self.seen


def test_a_model_s_caches_and_attributes_filled_while_tracing_are_taken_back():
    torch.manual_seed(0)
    model, x = Cached(), torch.randn(4, 6)
    Cached.index.cache_clear()
    capture(model, (x,), lambda m, a: m(a).square().mean(), "sgd")
    assert model.seen is None and Cached.index.cache_info().currsize == 0
    loss = model(x).square().mean()  # eagerly, after the capture: a real loss, not a fake one
    assert type(loss) is torch.Tensor and not isinstance(loss, torch._subclasses.FakeTensor)
    assert torch.allclose(loss, (model.lin(x).flip(1)).square().mean())


def test_caches_that_did_not_change_keep_their_entries():
    """Only the caches the traced code filled are emptied."""
    @functools.cache
    def square(n: int) -> int:
        return n * n

    square(3)
    model = nn.Linear(2, 2)
    with ModelState(model):
        model.extra = 1  # an attribute added inside is removed on exit
    assert square.cache_info().currsize == 1 and not hasattr(model, "extra")
    with ModelState(model):
        square(4)
    assert square.cache_info().currsize == 0
