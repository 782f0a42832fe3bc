"""Repeated-layer groups come from structure (containers, signatures, shapes), never from names."""

from __future__ import annotations

import pytest
import torch.nn as nn

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.capture.groups import parameter_groups

# Expected groups for each tiny zoo model, counted by hand from its definition:
EXPECTED = {
    "tiny-mlp": 4,  # 2 blocks x (fc1, fc2) x (weight, bias)
    "tiny-gpt2": 12,  # per block: ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj, each weight + bias
    "tiny-llama": 9,  # per layer: 2 RMSNorms, q/k/v/o, gate/up/down
    "tiny-moe": 11,  # GPT block's 8 (ln_1, c_attn, c_proj, ln_2 w+b) + router.weight, w_in, w_out
    "tiny-vit": 12,  # norm1, qkv, proj, norm2, fc1, fc2, each weight + bias
    # processor: 2 steps x (edge_mlp + node_mlp: 3 Linear + LayerNorm, w+b each) = 16; the node encoder,
    # edge encoder and decoder Sequentials each repeat their hidden Linear(16, 16) twice (w+b) = 6
    "tiny-gns": 22,
    "tiny-unet": 0,  # one ResBlock per level: nothing repeats
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_zoo_group_counts(name):
    model, inputs, loss_fn = models.build(name, device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    assert len(p.groups) == EXPECTED[name], [g.key for g in p.groups]
    for g in p.groups:
        assert len(g.params) >= 2
        assert all(p.value(n).shape == g.shape for n in g.params)
        # members: each parameter, its gradient, its optimizer states and updated values
        names = {p.values[m].name for m in g.members}
        for n in g.params:
            assert {n, f"grad[{n}]", f"opt.exp_avg[{n}]", f"updated[{n}]"} <= names


@pytest.mark.slow
def test_unet_groups_blocks_that_repeat():
    model, inputs, loss_fn = models.build("tiny-unet", {"blocks_per_level": "2"}, device="meta")
    keys = [g.key for g in capture(model, inputs, loss_fn, "sgd").groups]
    # the first down level keeps its width, so its two ResBlocks are identical (10 tensors each);
    # the second level's first block changes width (it has a skip conv), so it repeats nothing
    assert sum(k.startswith("down.0.blocks.*.") for k in keys) == 10
    assert not any(k.startswith("down.1.") for k in keys)


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.u = nn.Linear(8, 8)
        self.v = nn.Linear(8, 8)  # same type and shape as u, but a different layer of the unit


class _Renamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p1 = nn.ModuleList(_Unit() for _ in range(3))
        self.z = nn.Linear(8, 8)


def test_groups_do_not_depend_on_names():
    m = _Renamed()
    names = [n for n, _ in m.named_parameters()]
    shapes = {n: tuple(q.shape) for n, q in m.named_parameters()}
    groups = dict(parameter_groups(m, names, shapes))
    assert groups == {
        "p1.*.u.weight": ["p1.0.u.weight", "p1.1.u.weight", "p1.2.u.weight"],
        "p1.*.u.bias": ["p1.0.u.bias", "p1.1.u.bias", "p1.2.u.bias"],
        "p1.*.v.weight": ["p1.0.v.weight", "p1.1.v.weight", "p1.2.v.weight"],
        "p1.*.v.bias": ["p1.0.v.bias", "p1.1.v.bias", "p1.2.v.bias"],
    }


def test_siblings_that_differ_in_shape_are_not_repeats():
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    names = [n for n, _ in m.named_parameters()]
    groups = dict(parameter_groups(m, names, {n: tuple(q.shape) for n, q in m.named_parameters()}))
    assert groups == {"*.weight": ["1.weight", "2.weight"], "*.bias": ["1.bias", "2.bias"]}


def test_groups_that_share_a_key_are_told_apart_by_shape():
    """A Sequential of conv-BN-ReLU blocks repeats its BatchNorms four times and two of its convolutions:
    both groups are `*.weight`, so each key names its shape, and a repeated layer's peers are values of
    its own group (they had been the other group's: a tile of the convolutions raised an IndexError)."""
    import torch

    from partir_torch.ir import Mesh
    from partir_torch.propagate import ShardingState
    from partir_torch.tactics import Manual, apply_schedule

    def block(i: int, o: int, k: int = 1, g: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(i, o, k, padding=k // 2, groups=g, bias=False), nn.BatchNorm2d(o), nn.ReLU()]

    m = nn.Sequential(*block(3, 8, 3), *block(8, 8), *block(8, 8, 3, 2), *block(8, 8), nn.Flatten(), nn.Linear(128, 4))
    p = capture(m, (torch.randn(4, 3, 4, 4), torch.randint(0, 4, (4,))),
                lambda net, x, y: nn.functional.cross_entropy(net(x), y), "sgd")
    assert {(g.key, g.params) for g in p.groups if "weight" in g.key} == {
        ("*.weight@8", ("1.weight", "4.weight", "7.weight", "10.weight")),
        ("*.weight@8x8x1x1", ("3.weight", "9.weight"))}
    state = ShardingState(p, Mesh.parse("batch=2,model=4"))
    assert all(p.values[q].shape == p.values[v].shape for v, qs in state.peers.items() for q in qs)
    state = apply_schedule(p, Mesh.parse("batch=2,model=4"), [Manual({"3.weight": [None, "model", None, None]})])
    assert state.shard[p.params["9.weight"]].dims[1] == ("model",)  # its repeat, tiled alike
