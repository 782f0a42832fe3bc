"""Mixed precision: `torch.autocast` regions in the user's forward are captured as the casts torch runs, costed
at the dtype each tensor has (bf16 activations 2 bytes), and planned, searched and simulated; bf16 and fp16
models run through the same steps."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partir_torch.capture import capture
from partir_torch.cli import main
from partir_torch.ir import Mesh
from partir_torch.lower import lower
from partir_torch.simulate import simulate
from partir_torch.tactics import apply_schedule

B = 4


class Mlp(nn.Module):
    def __init__(self, amp: bool) -> None:
        super().__init__()
        self.amp = amp
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.amp):
            return self.fc2(torch.relu(self.fc1(x)))


def _loss(model, x, y):
    return F.mse_loss(model(x).float(), y)


def _setup(amp: bool = True):
    torch.manual_seed(0)
    m = Mlp(amp)
    x, y = torch.randn(B, 16), torch.randn(B, 8)
    return m, (x, y), capture(m, (x, y), _loss, "sgd")


def test_autocast_casts_are_captured_and_the_step_is_eagers():
    m, (x, y), p = _setup()
    fwd = [op for op in p.ops if op.phase.name == "FORWARD"]
    casts = [op for op in fwd if op.target == "aten._to_copy.default"
             and p.values[op.outputs[0]].dtype == torch.bfloat16]
    assert {op.module for op in casts} >= {"fc1", "fc2"}  # weights, biases and the input cast to bf16
    matmuls = [op for op in fwd if op.target == "aten.addmm.default"]
    assert [p.values[op.outputs[0]].dtype for op in matmuls] == [torch.bfloat16, torch.bfloat16]
    assert all(p.values[v].dtype == torch.float32 for v in [*p.params.values(), *p.grads.values()])
    out = p.run({n: q.detach() for n, q in m.named_parameters()}, {}, (x, y),
                {n: {"momentum_buffer": torch.zeros_like(q)} for n, q in m.named_parameters()})
    loss = _loss(m, x, y)
    loss.backward()
    assert torch.equal(out[p.loss], loss.detach())
    assert torch.allclose(out[p.grads["fc1.weight"]], m.fc1.weight.grad)


def test_bf16_activations_are_costed_at_two_bytes():
    def model_allreduce(amp: bool) -> int:
        _, _, p = _setup(amp)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Megatron finds the pair through autocast's weight casts
            state = apply_schedule(p, Mesh.parse("batch=2,model=2"), "batch:BatchParallel;model:Megatron")
        fwd = [c for c in lower(state)
               if c.axis == "model" and p.ops[p.values[c.value].producer].phase.name == "FORWARD"]
        assert len(fwd) == 1  # fc2's partial output, all-reduced over the model axis
        return fwd[0].bytes

    assert model_allreduce(True) == (B // 2) * 8 * 2  # bf16
    assert model_allreduce(False) == (B // 2) * 8 * 4  # the same plan in fp32


def test_autocast_model_plans_searches_and_simulates():
    from partir_torch.search import Budget, SearchConfig

    m, (x, y), p = _setup()
    params = {n: q.detach() for n, q in m.named_parameters()}
    states = {n: {"momentum_buffer": torch.randn_like(q) * 0.01} for n, q in params.items()}
    for schedule in ("batch:BatchParallel;model:Megatron", "batch:BatchParallel;model:Auto"):
        state = apply_schedule(p, Mesh.parse("batch=2,model=2"), schedule,
                               search=SearchConfig(budget=Budget(episodes=10)))
        sim = simulate(state.program, state, params, {}, (x, y), states)
        assert sim.max_rel_diff < 2e-2, schedule  # bf16 rounding of sums taken in another order


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_models_simulate_exact_in_float64(dtype, capsys):
    """A half-precision plan differs from its unsharded step by rounding only: each output kind within the
    dtype's rounding, and the float64 re-run (the models' own casts read as float64 too) exact."""
    argv = ["simulate", "tiny-llama", "--config", f"dtype={dtype}", "--mesh", "batch=2,model=2", "--schedule",
            "batch:BatchParallel;model:Megatron", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] and out["fp64_rel_diff"] <= 1e-9, out["fp64_rel_diff"]
    assert set(out["rel_diff_by_kind"]) >= {"loss", "gradients", "parameters", "optimizer_state"}
    assert out["rounding"] == {"bfloat16": 3e-2, "float16": 5e-3}[dtype]  # the step's least precise dtype
    for kind, rel in out["rel_diff_by_kind"].items():
        assert rel <= out["rounding"], (kind, rel)
    kinds = {(c["kind"], c["axis"]) for c in out["collectives"]}
    assert ("all-reduce", "model") in kinds
