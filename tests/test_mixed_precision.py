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


# -- the policy: Options(param_dtype=..., reduce_dtype=...), FSDP2's MixedPrecisionPolicy in the captured step --

def _policy_program(loop_kwargs, name="tiny-gpt2"):
    from partir_torch import models
    from partir_torch.ir.program import Loop

    torch.manual_seed(0)
    model, inputs, loss_fn = models.build(name, device="cpu")
    return model, inputs, loss_fn, capture(model, inputs, loss_fn, "adamw", loop=Loop(**loop_kwargs))


def test_policy_computes_in_param_dtype_and_keeps_fp32_masters():
    """The step's matmuls run in bf16 on casts of the fp32 parameters; the parameters, gradients and optimizer
    states the step takes and returns stay fp32; the model's float input is cast at its root forward."""
    torch.manual_seed(0)
    m = Mlp(amp=False)
    x, y = torch.randn(B, 16), torch.randn(B, 8)
    from partir_torch.ir.program import Loop

    p = capture(m, (x, y), _loss, "adamw", loop=Loop(param_dtype=torch.bfloat16))
    mms = [op for op in p.ops if op.target in ("aten.addmm.default", "aten.mm.default")]
    assert mms and all(p.values[op.outputs[0]].dtype == torch.bfloat16 for op in mms)
    assert all(p.values[v].dtype == torch.float32 for v in [*p.params.values(), *p.grads.values()])
    assert all(p.values[v].dtype == torch.float32 for st in p.opt_states.values() for v in st.values())
    # the step's loss and gradients are what FSDP2's policy computes: a bf16 working copy, fp32 gradients
    work = Mlp(amp=False)
    work.load_state_dict(m.state_dict())
    work.to(torch.bfloat16)
    loss = _loss(work, x.to(torch.bfloat16), y)
    loss.backward()
    params = {n: q.detach() for n, q in m.named_parameters()}
    states = {n: {k: torch.zeros(p.values[v].shape) for k, v in st.items()} for n, st in p.opt_states.items()}
    out = p.run(params, {}, (x, y), states)
    assert torch.equal(out[p.loss], loss.detach())
    for n, q in work.named_parameters():
        assert out[p.grads[n]].dtype == torch.float32
        assert torch.equal(out[p.grads[n]], q.grad.float()), n
    assert m.fc1.weight.dtype == torch.float32  # the model is left as it was


def test_gradients_are_reduced_in_reduce_dtype():
    """Data parallel under the policy: with reduce_dtype=float32 the weight gradients' pending sums pass the
    cast back and are all-reduced in float32 (FSDP2's choice, twice the bytes); without it, in bfloat16."""
    def grad_reductions(**kw):
        _, _, _, p = _policy_program(kw)
        state = apply_schedule(p, Mesh.parse("batch=2"), "batch:BatchParallel")
        by = {}
        for c in lower(state):
            if c.kind == "all-reduce" and len(p.values[c.value].shape) == 2:  # the weight gradients
                by.setdefault(p.values[c.value].dtype, []).append(c.bytes)
        return by

    half, full = grad_reductions(param_dtype="bfloat16"), grad_reductions(param_dtype="bfloat16",
                                                                          reduce_dtype="float32")
    assert set(half) == {torch.bfloat16}
    # every weight's gradient in fp32 but the tied embedding's two summands and wpe's (summed in bf16 before
    # the cast: an add or an embedding's backward is not a pass-through for a pending sum)
    assert torch.float32 in full and len(full[torch.float32]) >= len(half[torch.bfloat16]) - 3
    assert sum(full[torch.float32]) > 1.5 * sum(b for b in half[torch.bfloat16][:len(full[torch.float32])])


def test_policy_plan_simulates_within_bf16_rounding():
    model, inputs, _, p = _policy_program({"param_dtype": "bf16", "reduce_dtype": "fp32"})
    state = apply_schedule(p, Mesh.parse("batch=2,model=2"), "batch:BatchParallel;model:Megatron")
    params = {n: q.detach() for n, q in model.named_parameters()}
    states = {n: {k: (torch.tensor(2.0) if p.values[v].shape == () else torch.rand(p.values[v].shape) * 1e-2)
                  for k, v in st.items()} for n, st in p.opt_states.items()}
    sim = simulate(state.program, state, params, {}, inputs, states)
    assert 0 < sim.max_rel_diff < 2e-2  # bf16 sums taken in another order (and not zero: bf16 is computed)


def test_policy_options_name_the_dtype_and_the_fix():
    from partir_torch.errors import PartirError
    from partir_torch.options import Options

    assert Options(param_dtype=torch.bfloat16).param_dtype == "bfloat16"
    assert Options(param_dtype="bf16", reduce_dtype="fp32").reduce_dtype == "float32"
    with pytest.raises(PartirError, match=r"param_dtype='int8' is not a floating dtype .*bfloat16, float16"):
        Options(param_dtype="int8")
    with pytest.raises(PartirError, match="float8 has no matmul"):
        Options(param_dtype=torch.float8_e4m3fn)
    with pytest.raises(PartirError, match="reduce_dtype='float32' without param_dtype"):
        Options(reduce_dtype="float32")


def test_plan_keeps_the_policy(tmp_path):
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir.program import Loop
    from partir_torch.plan import ShardingPlan

    _, _, _, p = _policy_program({"param_dtype": "bf16", "reduce_dtype": "float32"})
    state = apply_schedule(p, Mesh.parse("batch=2"), "batch:BatchParallel")
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")))
    again = ShardingPlan.from_json(plan.to_json())
    assert Loop(**again.loop) == Loop(param_dtype="bfloat16", reduce_dtype="float32")
    assert "param_dtype=bfloat16" in str(Loop(**again.loop))


def test_a_dtype_the_device_cannot_compute_in_is_named(monkeypatch):
    from partir_torch.backends.distributed import engine
    from partir_torch.errors import PartirError

    engine.check_compute_dtype(torch.bfloat16, torch.device("cpu"))  # computes here

    def refuse(a, b):
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'BFloat16\'')

    monkeypatch.setattr(torch, "mm", refuse)
    with pytest.raises(PartirError, match=r"param_dtype=torch.bfloat16 cannot compute on this rank's cpu device.*"
                                          r"not implemented for 'BFloat16'"):
        engine.check_compute_dtype(torch.bfloat16, torch.device("cpu"))
