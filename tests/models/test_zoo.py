"""Tests for the model zoo: real tiny training steps, meta construction and counts, overrides, fake capture."""

from __future__ import annotations

import dataclasses
import math
import pickle
import time

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from partir_torch.models import build, config, describe, names
from partir_torch.models.moe import MoELayer, expert_capacity

EXPECTED_NAMES = [
    "mlp",
    "tiny-mlp",
    "gpt2-small",
    "gpt2-medium",
    "gpt2-xl",
    "gpt-6.7b",
    "tiny-gpt2",
    "llama-7b",
    "llama-13b",
    "llama-70b",
    "llama2-70b",
    "llama3-8b",
    "llama3-405b",
    "tiny-llama",
    "unet",
    "tiny-unet",
    "gns",
    "tiny-gns",
    "moe",
    "tiny-moe",
    "vit-base",
    "tiny-vit",
]
TINY = [n for n in EXPECTED_NAMES if n.startswith("tiny-")]

# Published parameter counts (unique parameters; GPT-2 with tied embeddings), relative tolerance 1%.
PUBLISHED = {
    "gpt2-small": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-xl": 1.558e9,
    "gpt-6.7b": 6.7e9,
    "llama-7b": 6.74e9,
    "llama-13b": 13.0e9,
    "llama-70b": 69.0e9,
    "llama2-70b": 69.0e9,
    "llama3-8b": 8.03e9,
    "llama3-405b": 405.9e9,
    "vit-base": 86.6e6,
}

# Repeated-layer containers whose children must be structurally identical.
REPEATED = {
    "mlp": "layers",
    "gpt2-small": "h",
    "llama-70b": "layers",
    "moe": "h",
    "vit-base": "blocks",
    "gns": "processor",
}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_names() -> None:
    assert names() == EXPECTED_NAMES
    assert all(describe(n) for n in names())


@pytest.mark.parametrize("name", TINY)
def test_tiny_training_step_on_cpu(name: str) -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn = build(name, device="cpu")
    loss = loss_fn(model, *inputs)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: no gradient for {pname}"
            assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"


@pytest.mark.parametrize("name", TINY)
def test_tiny_bfloat16(name: str) -> None:
    model, inputs, loss_fn = build(name, {"dtype": "bfloat16"}, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(x.dtype in (torch.bfloat16, torch.int64) for x in inputs)
    assert torch.isfinite(loss_fn(model, *inputs))


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_builds_on_meta_quickly(name: str) -> None:
    start = time.perf_counter()
    model, inputs, loss_fn = build(name)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"{name} took {elapsed:.2f}s to build on meta"
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers(), *inputs])
    count = n_params(model)
    if name in PUBLISHED:
        assert count == pytest.approx(PUBLISHED[name], rel=0.01), f"{name}: {count:,}"
    if name == "unet":
        assert 400e6 <= count <= 600e6, f"unet: {count:,}"
    assert pickle.loads(pickle.dumps(loss_fn)) is loss_fn
    # Constants must be registered buffers, never plain tensor attributes (they would escape capture).
    for mname, module in model.named_modules():
        stray = [k for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
        assert not stray, f"{name}.{mname}: plain tensor attributes {stray}"


@pytest.mark.parametrize("name", list(REPEATED))
def test_repeated_layers_are_identical_siblings(name: str) -> None:
    model, _, _ = build(name)
    container = getattr(model, REPEATED[name])
    assert isinstance(container, nn.ModuleList | nn.Sequential)
    signatures = {
        tuple((k, tuple(p.shape), p.dtype) for k, p in child.named_parameters()) for child in container
    }
    assert len(container) > 1 and len(signatures) == 1


def test_amp_llama_keeps_fp32_masters_and_runs_bf16() -> None:
    """`amp`: fp32 parameters, gradients and Adam states; the forward's matmuls, residual stream and saved
    activations in bf16 (what the cost model then counts at 2 bytes)."""
    from partir_torch.capture import capture
    from partir_torch.ir import Role

    model, inputs, loss_fn = build("tiny-llama", {"amp": "true"})
    program = capture(model, inputs, loss_fn, "adamw")
    persistent = [v for v in program.values if v.role in (Role.PARAMETER, Role.GRADIENT, Role.OPT_STATE)]
    assert persistent and all(v.dtype == torch.float32 for v in persistent)
    fwd = [op for op in program.ops if op.phase.name == "FORWARD" and op.target in ("aten.mm.default",
                                                                                      "aten.add.Tensor")
           and not op.module.endswith("norm")]  # RMSNorm's statistics stay fp32
    assert len(fwd) > 10 and all(program.values[op.outputs[0]].dtype == torch.bfloat16 for op in fwd)
    real, inputs, loss_fn = build("tiny-llama", {"amp": "true"}, device="cpu")
    assert torch.isfinite(loss_fn(real, *inputs))
    with pytest.raises(ValueError, match="master weights"):
        config("tiny-llama", {"amp": "true", "dtype": "bfloat16"})


def test_gpt_weight_tying() -> None:
    model, _, _ = build("tiny-gpt2", {"dtype": "bfloat16"}, device="cpu")
    assert model.lm_head.weight is model.wte.weight
    untied, _, _ = build("tiny-gpt2", {"tie": "false"})
    assert untied.lm_head.weight is not untied.wte.weight
    assert n_params(untied) == n_params(model) + 128 * 32


def test_override_layers() -> None:
    model, _, _ = build("tiny-gpt2", {"layers": "3"})
    assert len(model.h) == 3
    model, _, _ = build(
        "tiny-llama", {"layers": "1", "width": "64", "heads": "8", "kv_heads": "1"}, device="cpu"
    )
    assert len(model.layers) == 1 and model.layers[0].self_attn.k_proj.out_features == 8


def test_override_parsing() -> None:
    cfg = config("tiny-moe", {"capacity_factor": "2.5", "tie": "no", "attn": "math", "topk": 1})
    assert cfg.capacity_factor == 2.5 and cfg.tie is False and cfg.attn == "math" and cfg.topk == 1
    assert config("tiny-gpt2") == config("tiny-gpt2", {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layers = 5  # type: ignore[misc]


def test_unknown_override_key() -> None:
    with pytest.raises(ValueError, match="'nlayers'") as err:
        build("tiny-gpt2", {"nlayers": "3"})
    assert "layers" in str(err.value)  # lists the valid keys


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"layers": "three"}, "layers"),
        ({"tie": "maybe"}, "tie"),
        ({"attn": "flash"}, "attn"),
        ({"dtype": "int8"}, "dtype"),
        ({"heads": "5"}, "heads"),
    ],
)
def test_invalid_override_values(overrides: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config("tiny-gpt2", overrides)


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="gpt2-small") as err:
        build("gpt5")
    assert "gpt5" in str(err.value) and "tiny-vit" in str(err.value)
    with pytest.raises(ValueError, match="available"):
        config("nope")


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-moe", "tiny-vit"])
def test_attention_impls_agree(name: str) -> None:
    losses = []
    for impl in ("sdpa", "math"):
        torch.manual_seed(0)
        model, inputs, loss_fn = build(name, {"attn": impl}, device="cpu")
        losses.append(loss_fn(model, *inputs).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_cpu_inputs_are_valid_and_deterministic() -> None:
    _, first, _ = build("tiny-gns", device="cpu")
    _, second, _ = build("tiny-gns", device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    senders, receivers = first[2], first[3]
    assert int(senders.min()) >= 0 and int(max(senders.max(), receivers.max())) < config("tiny-gns").nodes


def test_moe_routing_respects_capacity() -> None:
    torch.manual_seed(0)
    layer = MoELayer(width=16, ffn=32, experts=4, topk=2, capacity_factor=1.0)
    x = torch.randn(64, 16)
    with torch.no_grad():
        dispatch, combine = layer.routing(x)
    cap = expert_capacity(64, 4, 2, 1.0)
    assert dispatch.shape == (64, 4, cap)
    assert (dispatch.sum(0) <= 1).all()  # each slot holds at most one token
    assert (dispatch.sum((1, 2)) <= 2).all()  # each token goes to at most topk experts
    assert (combine.sum((1, 2)) <= 1 + 1e-5).all()
    # With ample capacity nothing is dropped: every token's gates sum to one.
    roomy = MoELayer(width=16, ffn=32, experts=4, topk=2, capacity_factor=4.0)
    with torch.no_grad():
        _, combine = roomy.routing(x)
    assert torch.allclose(combine.sum((1, 2)), torch.ones(64))
    assert math.isclose(float(combine.sum()), 64.0, rel_tol=1e-5)


def _fake_trace(name: str, overrides: dict[str, str] | None = None) -> torch.fx.GraphModule:
    """Trace forward+loss+backward of a meta-built model with fake parameters, as capture does."""
    model, inputs, loss_fn = build(name, overrides, device="meta")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        params = {
            k: torch.empty(v.shape, dtype=v.dtype, requires_grad=v.requires_grad)
            for k, v in model.named_parameters()
        }
        buffers = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.named_buffers()}
        xs = tuple(torch.zeros(x.shape, dtype=x.dtype) for x in inputs)

    def step(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *args: torch.Tensor):
        # tie_weights=True: tied parameters (GPT lm_head/wte) appear once in named_parameters().
        with _reparametrize_module(model, {**p, **b}, tie_weights=True):
            loss = loss_fn(model, *args)
        return loss, torch.autograd.grad(loss, list(p.values()))

    return make_fx(step, tracing_mode="fake")(params, buffers, *xs)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [(n, None) for n in TINY] + [("tiny-gpt2", {"attn": "math"}), ("tiny-llama", {"attn": "math"})],
)
def test_tiny_models_trace_with_make_fx_on_fake(name: str, overrides: dict[str, str] | None) -> None:
    gm = _fake_trace(name, overrides)
    nodes = list(gm.graph.nodes)
    assert len(nodes) > 0
    # No tensor constants baked into the graph: everything comes in through params/buffers/inputs.
    assert not [n.target for n in nodes if n.op == "get_attr"]
