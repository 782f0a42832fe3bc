"""The torch backend on CPU gloo ranks: the plan's rank program gives the unsharded step's losses and
parameters, issues exactly the collectives `lower` predicts (by kind and mesh axis, nothing else), and holds
per-rank memory near the prediction; DTensor state dicts and DCP checkpoints; errors that never hang.

Ranks are started once per module (`Workers`) and reused by every test."""

from __future__ import annotations

import copy

import pytest
import torch

from partir_torch.launch import Workers

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.fixture(scope="module")
def four():
    with Workers(4, timeout=300) as w:
        yield w


@pytest.fixture(scope="module")
def two():
    with Workers(2, timeout=300) as w:
        yield w


def build(name: str, fp64: bool):
    from partir_torch import models
    from partir_torch.models import thirdparty

    torch.manual_seed(0)
    model, inputs, loss_fn = (thirdparty.build(name) if name in thirdparty.NAMES
                              else models.build(name, device="cpu"))
    if fp64:
        model = model.double()
        inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    return model, inputs, loss_fn


def replicated_peak(model, inputs, loss_fn, mesh) -> int:
    """The per-device memory of the plan that shards nothing (the searched plans get a fraction of it)."""
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir import Mesh
    from partir_torch.propagate import ShardingState

    program = capture(model, inputs, loss_fn, "adamw")
    return evaluate(ShardingState(program, Mesh.parse(mesh)), hardware("cpu-virtual")).peak_memory_bytes


def train_case(rank, world, name, mesh, schedule, compile=False, fp64=True, memory=None, steps=3):
    """Shard `name` under `schedule` (None: searched under `memory` x the replicated plan's memory), measure one
    step, train `steps` AdamW steps beside the unsharded eager model from the same start; each rank's figures."""
    import partir_torch
    from partir_torch.backends.distributed import engine, measure

    model, inputs, loss_fn = build(name, fp64)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    limit = None if memory is None else memory * replicated_peak(model, inputs, loss_fn, mesh)
    model, opt = partir_torch.auto_shard(model, inputs, mesh, loss_fn=loss_fn, optimizer=opt, schedule=schedule,
                                         memory=limit, budget=30, backend="torch", compile=compile, cache=False)
    rec = engine.sharded(model)
    run = measure.run_once(rec, model, opt, inputs)
    cmp = measure.compare(rec, run)
    losses, ref_losses = [], []
    for _ in range(steps):
        rng = torch.get_rng_state()
        losses.append(float(partir_torch.step(model, opt, *inputs)))
        torch.set_rng_state(rng)  # the unsharded step draws the same dropout masks
        loss = loss_fn(ref, *inputs)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    rel = max(((full[n] - p).abs().max() / p.abs().max().clamp(min=1)).item() for n, p in ref.named_parameters())
    sharded = sum(any(s is not None for s in spec) for spec in rec.plan.params.values())
    return {"losses": losses, "ref": ref_losses, "rel": rel, "rows": cmp["by_axis"], "unexpected": cmp["unexpected"],
            "mem": (cmp["measured_peak"], cmp["predicted_peak"]), "sharded": sharded, "axes": _axes_used(rec)}


def _axes_used(rec) -> list[str]:
    """The mesh axes the plan splits anything over (parameters, inputs, optimizer states)."""
    plan = rec.plan
    specs = [*plan.params.values(), *plan.inputs, *(s for st in plan.optimizer_state.values() for s in st.values())]
    return sorted({a for spec in specs for e in spec if e for a in ([e] if isinstance(e, str) else e)})


def check(results, *, memory_tolerance=0.15):
    for r in results:
        assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(r["losses"], r["ref"])) <= 1e-5, r
        assert r["rel"] <= 1e-5, r
        bad = [row for row in r["rows"] if abs(row["measured"] - row["predicted"]) > 0.01 * max(1, row["predicted"])]
        assert not bad and not r["unexpected"], (bad, r["unexpected"])
        measured, predicted = r["mem"]
        assert abs(measured / predicted - 1) <= memory_tolerance, r["mem"]


EXPERTS = {"4": "batch:BatchParallel;model:Megatron;batch:ZeRO(1)", "2": "batch:FSDP"}


@pytest.mark.parametrize("name", ["tiny-mlp", "tiny-gpt2", "tiny-llama", "tiny-unet", "tiny-gns", "tiny-moe"])
def test_zoo_expert_plans_run_as_predicted_and_train_as_unsharded(four, two, name):
    check(four.run(train_case, name, "batch=2,model=2", EXPERTS["4"]))
    check(two.run(train_case, name, "batch=2", EXPERTS["2"]))


@pytest.mark.thirdparty
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-t5", "tv-resnet18"])
def test_users_models_under_expert_plans(four, name):
    check(four.run(train_case, name, "batch=2,model=2", EXPERTS["4"]))


@pytest.mark.parametrize(("name", "fraction"), [("tiny-gpt2", 0.4), ("tiny-moe", 0.6), ("tiny-gns", 0.6)])
def test_searched_plans_under_a_memory_limit_run_as_predicted_and_train_as_unsharded(four, name, fraction):
    """Searched on rank 0 under a fraction of the replicated plan's memory (so more than the batch is split),
    agreed by every rank, then held to the same bars as the expert plans."""
    results = four.run(train_case, name, "batch=2,model=2", None, False, True, fraction)
    check(results)
    assert results[0]["sharded"] and "model" in results[0]["axes"], results[0]
