"""Plans proven through torch_xla on the 8-device CPU mesh: same loss and updated parameters as unsharded."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from partir_torch import capture, models
from partir_torch.ir import Mesh
from partir_torch.plan import specs
from partir_torch.tactics import apply_schedule

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla not installed")


@pytest.mark.parametrize(
    ("model", "schedule"),
    [("tiny-llama", "batch:BatchParallel;model:Megatron;batch:ZeRO(1)"), ("tiny-mlp", "batch:FSDP")],
)
def test_plan_through_torch_xla_matches_unsharded(model, schedule):
    from partir_torch.backends.xla import reference_step, run_step

    mesh = Mesh.parse("batch=2,model=4")
    net, inputs, loss_fn = models.build(model, device="meta")
    program = capture(net, inputs, loss_fn, "adamw")
    state = apply_schedule(program, mesh, schedule)
    sp = specs(state)
    assert any(any(s) for s in sp.params.values())
    xla = run_step(model, mesh, sp.params, sp.inputs, sp.optimizer_state, return_params=True)
    loss, params = reference_step(model)
    assert xla.loss == pytest.approx(loss, abs=1e-5)
    for n, ref in params.items():
        torch.testing.assert_close(torch.tensor(xla.params_after[n]), torch.tensor(ref), atol=1e-5, rtol=1e-5)
