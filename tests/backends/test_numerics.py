"""Searched plans, applied as `auto_shard` applies them, train like unsharded: several steps on the 8-device
CPU mesh give the unsharded losses and parameters (fp32, 1e-5 relative to each tensor's largest value)
for every zoo family but the U-Net, on the three meshes.

The plans are searched under a memory limit of half the replicated step, so that they must shard weights.
SGD with momentum: Adam's first steps divide each gradient by its own magnitude, so a gradient that is zero
up to rounding (GPT's key bias: softmax ignores a shift of k) comes out as +-lr whichever way the sum was
ordered; `test_adamw_plans_train_like_unsharded` covers Adam on models without such gradients.
"""

from __future__ import annotations

import pytest

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cost import evaluate, hardware
from partir_torch.ir import Mesh
from partir_torch.search.api import search
from partir_torch.tactics import apply_schedule
from tests import needs

pytestmark = pytest.mark.xla
MODELS = ["tiny-mlp", "tiny-gpt2", "tiny-llama", "tiny-unet", "tiny-gns", "tiny-moe"]
MESHES = ["batch=8", "batch=2,model=4", "batch=2,model=2,x=2"]


def _searched(name: str, mesh: str, optimizer: str):
    overrides = {} if name == "tiny-gns" else {"batch": "8"}  # a batch every batch axis divides
    net, inputs, loss_fn = models.build(name, overrides, device="meta")
    replicated = evaluate(apply_schedule(capture(net, inputs, loss_fn, optimizer), Mesh.parse(mesh), []),
                          hardware("cpu-virtual"))
    plan = search(net, inputs, mesh, loss_fn=loss_fn, optimizer=optimizer, budget=100,
                  memory=int(0.5 * replicated.peak_memory_bytes))
    sharded = [n for n, s in plan.params.items() if any(s)] + [i for i, s in enumerate(plan.inputs) if s and any(s)]
    assert sharded, f"the plan for {name} on {mesh} shards nothing: the check would be vacuous"
    return plan, overrides


# each family on one mesh, every mesh by some family; not the U-Net (its XLA compile alone took 48 s
# of the suite's 15 minutes): `benchmarks/engine.py` runs every zoo model's searched plan on the three meshes
# through both engines, and tests/backends/test_distributed.py the U-Net's expert plans on the torch backend
ON = {"tiny-mlp": [MESHES[2]], "tiny-gpt2": [MESHES[1]], "tiny-llama": [MESHES[0]], "tiny-unet": [],
      "tiny-moe": [MESHES[1]], "tiny-gns": [MESHES[1]]}
CASES = [(n, m) for n in MODELS for m in ON[n]]


@pytest.mark.parametrize(("name", "mesh"), CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_searched_plans_train_like_unsharded(name, mesh):
    from partir_torch.backends.verify import verify_workload

    plan, overrides = _searched(name, mesh, "sgd")
    report = verify_workload(plan, name, overrides, steps=3, numerics=True)
    assert len(report.losses) == 3 and report.losses == pytest.approx(report.reference_losses, rel=1e-5)
    assert report.max_rel_diff <= 1e-5, (report.max_abs_diff, report.max_rel_diff)


@pytest.mark.parametrize("name", ["tiny-mlp"])
def test_adamw_plans_train_like_unsharded(name):
    from partir_torch.backends.verify import verify_workload

    plan, overrides = _searched(name, "batch=2,model=4", "adamw")
    report = verify_workload(plan, name, overrides, steps=3, numerics=True)
    assert report.max_rel_diff <= 1e-5, (report.max_abs_diff, report.max_rel_diff)


def test_a_transformers_gpt2_with_its_tied_table_tiled_on_rows_trains_like_unsharded():
    """Vocab-parallel embedding on the engine, on a users' model: HF GPT-2's tied `wte` tiled on its rows over
    `model` (a masked lookup whose result XLA all-reduces), the batch over `batch`; dropout off (torch_xla
    draws per shard, docs/apply.md)."""
    import torch

    import partir_torch
    from benchmarks.workloads.thirdparty import BUILDERS
    from partir_torch.ir import Tile
    from partir_torch.plan import ShardingPlan
    from partir_torch.propagate import ShardingState
    from partir_torch.rules.decompose import prepare

    needs.need("transformers")
    torch.manual_seed(0)
    model, inputs, loss_fn = BUILDERS["hf-gpt2"]()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    program = prepare(capture(model, inputs, loss_fn, "sgd"))
    state = ShardingState(program, Mesh.parse("batch=2,model=4"))
    state.apply(Tile("transformer.wte.weight", 0, "model"))
    state.apply(Tile(program.values[program.inputs[0]].name, 0, "batch"))
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), hardware="cpu-virtual")
    assert plan.params["transformer.wte.weight"] == ["model", None]
    j = partir_torch.verify(model, inputs, plan=plan, loss_fn=loss_fn, optimizer="sgd", numerics=True,
                            steps=3).to_json()
    assert j["max_rel_diff"] <= 1e-5, (j["losses"], j["reference_losses"])
    assert j["unexpected_collectives"] == []
    # XLA sums the lookups over the table's rows as the plan predicts (it gathers no table); the softmax over
    # the vocab-tiled logits it computes from all-reduced statistics, where the plan gathers them (8 KiB)
    rows = {(r["kind"], tuple(r["axes"])): r for r in j["by_axis"]}
    assert rows["all-reduce", ("model",)]["measured"] == pytest.approx(rows["all-reduce", ("model",)]["predicted"],
                                                                       rel=0.1)
