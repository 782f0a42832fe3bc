"""The torch backend on CPU gloo ranks: the plan's rank program gives the unsharded step's losses and
parameters, issues exactly the collectives `lower` predicts (by kind and mesh axis, nothing else), and holds
per-rank memory near the prediction; DTensor state dicts and DCP checkpoints; errors that never hang.

Ranks are started once per module (`Workers`) and reused by every test."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")]


class AttributeTable(torch.nn.Module):
    """A table kept as a plain tensor attribute, not a buffer (HF GPT-J's rotary `embed_positions`): a constant
    of the captured program."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)
        self.table = torch.randn(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids) * self.table.repeat(ids.shape[0], 1, 1))


def _table_loss(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def build(name: str, fp64: bool):
    from benchmarks.workloads import thirdparty
    from partir_torch import models

    torch.manual_seed(0)
    name, _, over = name.partition(":")  # "tiny-gpt2:heads=2": a zoo model with config overrides
    if name == "attribute-table":
        model, inputs, loss_fn = AttributeTable(), (torch.randint(0, 32, (4, 8)),), _table_loss
    elif name == "sliced-batch":  # tokens sliced from longer rows (`data[:, :-1]`): not row-major
        model, inputs, loss_fn = AttributeTable(), (torch.randint(0, 32, (4, 9))[:, :-1],), _table_loss
    else:
        model, inputs, loss_fn = (thirdparty.build(name) if name in thirdparty.NAMES else
                                  models.build(name, dict(kv.split("=") for kv in over.split(",") if kv),
                                               device="cpu"))
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


def train_case(rank, world, name, mesh, schedule, compile=False, fp64=True, memory=None, steps=3, optimizer="adamw",
               scheduled=False):
    """Shard `name` under `schedule` (None: searched under `memory` x the replicated plan's memory), measure one
    step, train `steps` steps of `optimizer` (a torch.optim class by capture's name, lr 1e-2; `scheduled`: under
    an LR scheduler, warmup then decay, built on the returned optimizer) beside the unsharded eager model from the
    same start; each rank's figures."""
    import partir_torch
    from partir_torch.backends.distributed import engine, measure
    from partir_torch.capture.optim import CLASSES

    model, inputs, loss_fn = build(name, fp64)
    ref = copy.deepcopy(model)
    opt = CLASSES[optimizer](model.parameters(), lr=1e-2)
    ref_opt = CLASSES[optimizer](ref.parameters(), lr=1e-2)
    limit = None if memory is None else memory * replicated_peak(model, inputs, loss_fn, mesh)
    plan = _decided(model, inputs, loss_fn, opt, mesh, schedule) if isinstance(schedule, list) else None
    model, opt = partir_torch.auto_shard(model, inputs, mesh, loss_fn=loss_fn, optimizer=opt,
                                         schedule=None if plan else schedule, plan=plan, memory=limit, budget=30,
                                         backend="torch", compile=compile, cache=False)
    rec = engine.sharded(model)
    run = measure.run_once(rec, model, opt, inputs)
    cmp = measure.compare(rec, run)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 2) * 0.5 ** s) if scheduled else None
              for o in (opt, ref_opt)]
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
        for s in scheds if scheduled else ():
            s.step()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    rel = max(((full[n] - p).abs().max() / p.abs().max().clamp(min=1)).item() for n, p in ref.named_parameters())
    sharded = sum(any(s is not None for s in spec) for spec in rec.plan.params.values())
    return {"losses": losses, "ref": ref_losses, "rel": rel, "rows": cmp["by_axis"], "unexpected": cmp["unexpected"],
            "mem": (cmp["measured_peak"], cmp["predicted_peak"]), "sharded": sharded, "axes": _axes_used(rec),
            "params": rec.plan.params}


def _decided(model, inputs, loss_fn, opt, mesh, decisions: list[str]):
    """The plan of these decisions (action strings, as a search log or a plan file holds them)."""
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir import Mesh, parse_action
    from partir_torch.plan import ShardingPlan
    from partir_torch.tactics.schedule import replay

    state = replay(capture(model, inputs, loss_fn, opt), Mesh.parse(mesh), [parse_action(a) for a in decisions])
    return ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")))


def _axes_used(rec) -> list[str]:
    """The mesh axes the plan splits anything over (parameters, inputs, optimizer states)."""
    plan = rec.plan
    specs = [*plan.params.values(), *plan.inputs, *(s for st in plan.optimizer_state.values() for s in st.values())]
    return sorted({a for spec in specs for e in spec if e for a in ([e] if isinstance(e, str) else e)})


def check(results, *, memory_tolerance=0.15):
    """Each rank's run: losses and parameters as unsharded, every collective row as predicted (+-1 %) and none
    unplanned, memory as predicted; and the plan shards something and runs a collective (a plan that shards
    nothing would pass the rest trivially)."""
    for r in results:
        assert r["axes"], "the plan shards nothing (no parameter, input or optimizer state is split)"
        assert any(row["predicted"] > 0 and row["measured"] > 0 for row in r["rows"]), r["rows"]
        assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(r["losses"], r["ref"])) <= 1e-5, r
        assert r["rel"] <= 1e-5, r
        bad = [row for row in r["rows"] if abs(row["measured"] - row["predicted"]) > 0.01 * max(1, row["predicted"])
               or row["measured_calls"] != row["predicted_calls"]]  # (reductions bucketed as planned)
        assert not bad and not r["unexpected"], (bad, r["unexpected"])
        measured, predicted = r["mem"]
        assert abs(measured / predicted - 1) <= memory_tolerance, r["mem"]


def test_check_refuses_a_run_that_shards_nothing():
    """`check` itself: an exact run of a plan that splits nothing and runs no collective is not a pass."""
    run = {"losses": [1.0], "ref": [1.0], "rel": 0.0, "rows": [], "unexpected": [], "mem": (10, 10), "axes": []}
    with pytest.raises(AssertionError, match="shards nothing"):
        check([run])
    with pytest.raises(AssertionError):
        check([{**run, "axes": ["batch"]}])  # split, but no collective row ran
    check([{**run, "axes": ["batch"], "rows": [{"predicted": 64, "measured": 64, "predicted_calls": 1,
                                               "measured_calls": 1}]}])


EXPERTS = {"4": "batch:BatchParallel;model:Megatron;batch:ZeRO(1)", "2": "batch:FSDP"}


@pytest.mark.parametrize("name", ["tiny-mlp", "tiny-gpt2", "tiny-llama", "tiny-gns", "tiny-moe"])
def test_zoo_expert_plans_run_as_predicted_and_train_as_unsharded(four, two, name):
    """DP + Megatron + ZeRO-1 on 4 ranks; FSDP on 2 (for two of them: the suite's time). The U-Net runs under
    its own plan below (`benchmarks/engine.py` runs every zoo model's expert plans)."""
    check(four.run(train_case, name, "batch=2,model=2", EXPERTS["4"]))
    if name in ("tiny-mlp", "tiny-gpt2"):
        check(two.run(train_case, name, "batch=2", EXPERTS["2"]))


def test_megatron_over_more_devices_than_heads_runs_as_predicted_and_trains_as_unsharded(four):
    """2 heads over 4 devices: each holds half a head of the fused q/k/v (uneven blocks of the split), which
    no tiling of the heads is: the attention's views are resharded from the layout each holds, not re-viewed
    from their root's (`lower.pull_back`), and gathers of uneven blocks pad them."""
    check(four.run(train_case, "tiny-gpt2:heads=2", "model=4", "model:Megatron"))


def test_a_u_net_plan_whose_reshards_leave_group_norm_a_strided_operand(four):
    """A searched plan of the bench (`benchmarks/results/engine.json`, tiny-unet on {batch:2, model:4}; here on
    {batch:2, model:2}): a reshard gives GroupNorm a non-contiguous local tensor, which its kernel refuses."""
    decisions = ["tile(up.1.blocks.1.skip.weight, 1, model)", "tile(down.1.blocks.0.conv1.weight, 0, batch)",
                 "tile(time_embed.2.weight, 0, batch)", "tile(down.0.blocks.0.conv1.weight, 0, batch)",
                 "tile(down.1.blocks.0.skip.weight, 0, batch)", "tile(up.0.blocks.0.conv2.weight, 1, batch)",
                 "tile(up.0.blocks.1.conv1.weight, 0, batch)", "tile(up.0.blocks.1.skip.weight, 1, batch)",
                 "tile(inputs[2], 0, batch)"]
    check(four.run(train_case, "tiny-unet", "batch=2,model=2", decisions))


@pytest.mark.thirdparty
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-t5", "timm-resnet10t"])
def test_users_models_under_expert_plans(four, name):
    """(Every model of the sweep: `benchmarks/torch_users.py`, `docs/distributed.md`.)"""
    check(four.run(train_case, name, "batch=2,model=2", EXPERTS["4"]))


@pytest.mark.thirdparty
def test_multihead_attention_is_split_by_heads_and_trains_as_unsharded(four):
    """`nn.MultiheadAttention` (a stock `nn.TransformerEncoder` LM under causal and padding masks, with torch's
    dropout): Megatron splits the packed q/k/v weight by heads (`capture/attention.py`)."""
    results = four.run(train_case, "torch-transformer-encoder", "batch=2,model=2", EXPERTS["4"])
    check(results)
    packed = {n: spec for n, spec in results[0]["params"].items() if n.endswith("in_proj_weight")}
    assert packed and all(spec == ["model", None] for spec in packed.values()), packed


@pytest.mark.parametrize(("name", "fraction"), [("tiny-gpt2", 0.4), ("tiny-moe", 0.6), ("tiny-gns", 0.6)])
def test_searched_plans_under_a_memory_limit_run_as_predicted_and_train_as_unsharded(four, name, fraction):
    """Searched on rank 0 under a fraction of the replicated plan's memory (so more than the batch is split),
    agreed by every rank, then held to the same bars as the expert plans."""
    results = four.run(train_case, name, "batch=2,model=2", None, False, True, fraction)
    check(results)
    assert results[0]["sharded"] and "model" in results[0]["axes"], results[0]


@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop", "adagrad", "adafactor", "nadam", "radam", "adamax"])
def test_every_optimizer_s_states_are_sharded_and_train_as_torch_optim(two, optimizer):
    """FSDP shards each optimizer's states with its parameters (Adafactor's factored row / column moments
    too); three steps under an LR scheduler (the lr changes every step: an input of the rank program) equal
    torch.optim's on the unsharded model, and the collectives are as predicted."""
    results = two.run(train_case, "tiny-gpt2", "batch=2", EXPERTS["2"], False, True, None, 3, optimizer, True)
    check(results)
    assert results[0]["axes"] == ["batch"], results[0]


def test_a_tensor_the_model_keeps_as_a_plain_attribute_is_a_constant_of_the_rank_program(two):
    check(two.run(train_case, "attribute-table", "batch=2", EXPERTS["2"]))


def test_a_convnext_whose_norm_gradient_is_gathered_runs_as_unsharded(four):
    """torchvision's ConvNeXt under a plan the search found for it (float64, 0.6 x the replicated memory): a
    channels-last LayerNorm's input gradient, sliced and permuted back, is all-gathered; its fake strides said
    row-major, the CPU's were not (`rank._guard_collective_inputs`)."""
    decisions = ["tile(features.3.0.block.3.bias, 0, batch)", "tile(features.1.0.block.5.weight, 1, batch)",
                 "tile(features.1.0.block.0.weight, 0, batch)", "tile(features.3.0.block.3.bias, 0, model)",
                 "tile(features.3.0.block.0.weight, 0, model)", "tile(features.1.0.block.5.weight, 1, model)"]
    check(four.run(train_case, "tv-convnext", "batch=2,model=2", decisions, False, True, None, 2))


def test_a_batch_that_is_not_row_major_is_fed_row_major(two):
    """The captured step may `view` an input (the loss's `flatten`), as it may on the row-major example; a rank's
    part of a sliced batch is not row-major, so the engine feeds it contiguous."""
    check(two.run(train_case, "sliced-batch", "batch=2", EXPERTS["2"]))


def same_batch_case(rank, world, differ):
    from partir_torch import PartirError
    from partir_torch.backends.distributed.shard import same_tensors

    x = torch.arange(12).reshape(3, 4) + (rank if differ else 0)
    try:
        same_tensors([x.t(), torch.ones(2)], "first training batch", "seed the loader alike")
    except PartirError as e:
        return str(e)
    return None


def test_ranks_reading_different_batches_all_raise(two):
    """(`AutoShardStrategy` on the torch backend checks its first batch: a loader that draws apart on each rank.)"""
    assert two.run(same_batch_case, False) == [None, None]
    for msg in two.run(same_batch_case, True):
        assert msg is not None and "the ranks hold different first training batch" in msg and "[0]" in msg \
            and "[1]" in msg and "seed the loader alike" in msg, msg


def compiled_case(rank, world, name):
    """The rank program through torch.compile (inductor): the same losses and parameters as unsharded."""
    return train_case(rank, world, name, "batch=2", EXPERTS["2"], True)


def test_compiled_rank_program_trains_as_unsharded(two):
    check(two.run(compiled_case, "tiny-mlp"))


def state_dict_case(rank, world, directory):
    """DTensor state dicts as FSDP2 users read them, and a DCP checkpoint saved, then loaded into a model
    sharded again from the same plan: the same parameters and optimizer states, and the same next loss (and
    a warning for the LR scheduler left on the optimizer passed in)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    import partir_torch

    model, inputs, loss_fn = build("tiny-gpt2", False)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(opt, 1)  # on the optimizer passed in: it would schedule nothing that trains
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, opt = partir_torch.auto_shard(model, inputs, "batch=2,model=2", loss_fn=loss_fn, optimizer=opt,
                                             schedule=EXPERTS["4"], backend="torch", cache=False)
    warned = any("an LR scheduler was built on the optimizer passed to auto_shard" in str(w.message) for w in seen)
    partir_torch.step(model, opt, *inputs)
    sd = model.state_dict()
    assert all(isinstance(t, DTensor) for t in sd.values())
    strided = _strided_states_are_the_plan_s(model, opt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert set(full) == set(sd) and all(torch.equal(full[n], sd[n].full_tensor()) for n in sd)
    dcp.save({"model": sd, "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=directory)
    saved = {n: t.full_tensor().clone() for n, t in sd.items()}
    next_loss = float(partir_torch.step(model, opt, *inputs))

    again = copy.deepcopy(ref)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    again, opt2 = partir_torch.auto_shard(again, inputs, "batch=2,model=2", loss_fn=loss_fn, optimizer=opt2,
                                          plan=model.partir_plan, backend="torch")
    state = {"model": again.state_dict(), "optim": get_optimizer_state_dict(again, opt2)}
    dcp.load(state, checkpoint_id=directory)
    again.load_state_dict(state["model"])
    set_optimizer_state_dict(again, opt2, state["optim"])
    same = all(torch.equal(saved[n], t.full_tensor()) for n, t in again.state_dict().items())
    restored = float(partir_torch.step(again, opt2, *inputs))
    # a whole optimizer state dict loaded back (its betas come back a list: the same hyperparameters) steps on
    whole = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(again, opt2, get_optimizer_state_dict(again, opt2, options=whole), options=whole)
    partir_torch.step(again, opt2, *inputs)
    return same and strided and warned, next_loss, restored


def _strided_states_are_the_plan_s(model, opt) -> bool:
    """ZeRO-1 on `batch` after Megatron on `model` splits a state's dim (model, batch), against the mesh's order:
    its DTensor (`_StridedShard`) gathers to the same whole tensor as the plan's own layout of its parts."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from partir_torch.backends.distributed import engine
    from partir_torch.backends.distributed.verify import _whole

    rec = engine.sharded(model)
    names = {id(p): n for n, p in model.named_parameters()}
    strided = 0
    for p, st in opt.state.items():
        for s, t in st.items():
            if t.dim() == 0:
                continue
            strided += any(isinstance(x, _StridedShard) for x in t.placements)
            vid = rec.state.program.opt_states[names[id(p)]][s]
            if not torch.equal(t.full_tensor(), _whole(t.to_local(), vid, rec)):
                return False
    return strided > 0


def test_dtensor_state_dicts_and_a_dcp_checkpoint_round_trip(four, tmp_path):
    for same, expected, got in four.run(state_dict_case, str(tmp_path / "ckpt")):
        assert same and got == pytest.approx(expected, rel=1e-6)


def test_without_a_process_group_the_error_says_how_to_start_one(tiny):
    import partir_torch
    from partir_torch.backends.distributed.runtime import DistributedError

    model, inputs, loss_fn = tiny
    before = {n: p.clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(DistributedError, match=r"torchrun --nproc-per-node 4 .*launch\.spawn\(fn, 4\)"):
        partir_torch.auto_shard(model, inputs, {"batch": 2, "model": 2}, loss_fn=loss_fn, optimizer=opt,
                                backend="torch")
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()) and not opt.state
    assert not hasattr(model, "partir_plan")


def bad_input_case(rank, world, what):
    import partir_torch

    model, inputs, loss_fn = build("tiny-mlp", False)
    if what == "other-model" and rank == 1:  # one rank builds another model: it must not train another plan
        from partir_torch import models

        torch.manual_seed(0)
        model, inputs, loss_fn = models.build("tiny-mlp", {"width": "32"}, device="cpu")
    mesh = "batch=2,model=4" if what == "mesh" else "batch=2,model=2"
    opt = torch.optim.AdamW(model.parameters())
    try:
        model, opt = partir_torch.auto_shard(model, inputs, mesh, loss_fn=loss_fn, optimizer=opt,
                                             schedule="batch:BatchParallel", backend="torch", cache=False)
    except partir_torch.PartirError as e:
        return str(e), hasattr(model, "partir_plan")
    if what == "other-batch":  # each rank its own data, as under DDP: refused at the first step
        mine = tuple(x + rank if x.is_floating_point() else x for x in inputs)
        try:
            partir_torch.step(model, opt, *mine)
        except partir_torch.PartirError as e:
            return str(e), True
        return None, True
    errors = []
    for plain in (lambda: loss_fn(model, *inputs).backward(), opt.step):
        try:
            plain()
        except partir_torch.PartirError as e:
            errors.append(str(e))
    return (errors[0] if len(errors) == 2 else None), hasattr(model, "partir_plan")


@pytest.mark.parametrize(("what", "message"), [
    ("mesh", r"the process group has 4 ranks but the mesh Mesh\{batch:2, model:4\} spans 8 devices"),
    ("other-model", r"the ranks hold different initial weights \(digests by rank: .*\[1\]"),
    ("plain-loop", r"`loss = partir_torch.step\(model, optimizer, \*batch\)`"),
    ("other-batch", r"the ranks hold different global batches .*every rank must pass the whole global batch"),
])
def test_bad_input_is_an_error_on_every_rank_never_a_hang(four, what, message):
    import re

    for msg, flag in four.run(bad_input_case, what):
        assert msg is not None and re.search(message, msg), msg
        assert flag is (what in ("plain-loop", "other-batch"))  # (sharded where the error comes at a step)


def plan_file_case(rank, world, path):
    import partir_torch

    model, inputs, loss_fn = build("tiny-gpt2", False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = partir_torch.auto_shard(model, inputs, "batch=2,model=2", loss_fn=loss_fn, optimizer=opt, plan=path,
                                         backend="torch")
    losses = [float(partir_torch.step(model, opt, *inputs)) for _ in range(3)]
    report = partir_torch.verify(model, inputs, steps=2)  # on copies: the model trains on unchanged
    assert float(partir_torch.step(model, opt, *inputs)) < losses[-1]
    return losses, report.to_json(), report.table()


@pytest.mark.xla
def test_one_plan_file_gives_the_same_losses_on_both_backends(four, tmp_path):
    """A searched plan saved once, run by torch_xla SPMD (a fresh process, `verify`'s) and by the torch backend
    on 4 gloo ranks: the same three losses."""
    from partir_torch.backends.verify import verify
    from partir_torch.search.api import search

    model, inputs, loss_fn = build("tiny-gpt2", False)
    plan = search(model, inputs, "batch=2,model=2", loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                  budget=30, memory=300_000, cache=False)
    plan.save(tmp_path / "plan.json")
    xla = verify(plan, model, inputs, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                 steps=3, numerics=True).losses
    for losses, report, table in four.run(plan_file_case, str(tmp_path / "plan.json")):
        assert losses == pytest.approx(xla, rel=1e-5), (losses, xla)
        # `partir_torch.verify` on the torch backend: the rank's collectives and memory against the plan
        assert report["unexpected_collectives"] == [] and set(report["ratios"].values()) == {1.0}, report["ratios"]
        assert abs(report["memory_ratio"] - 1) <= 0.15, report["memory_ratio"]
        # (float32: parameters whose gradient is zero by symmetry differ by Adam-scaled rounding, docs/distributed.md)
        assert report["losses"] == pytest.approx(report["reference_losses"], rel=1e-5), report
        assert "no collective the plan did not predict" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the check itself")
def test_the_gpu_check_skips_cleanly_without_cuda():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "gpu.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "no CUDA device found; skipped" in r.stdout, r.stderr[-2000:]


def test_ranks_that_hold_different_values_are_named_by_value():
    from partir_torch.backends.distributed.runtime import DistributedError
    from partir_torch.backends.distributed.shard import _agree

    _agree(["a1", "a1", "a1"], "plans", "digests", "seed them alike")  # all alike: nothing to say
    with pytest.raises(DistributedError, match=r"the ranks hold different plans \(digests by rank: "
                                               r"\{'a1': \[0, 2\], 'b2': \[1\]\}\); seed them alike"):
        _agree(["a1", "b2", "a1"], "plans", "digests", "seed them alike")


def reshard_case(rank, world):
    """Unshard mid-training (say, to save whole weights), then shard again with the optimizer `auto_shard`
    returned: it is the user's AdamW again, on the model's own parameters with its trained states."""
    import partir_torch

    model, inputs, loss_fn = build("tiny-gpt2", True)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = partir_torch.auto_shard(model, inputs, "batch=2", loss_fn=loss_fn, cache=False, progress=False,
                                         optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                         schedule=EXPERTS["2"])
    plan = model.partir_plan
    partir_torch.step(model, opt, *inputs)
    partir_torch.unshard(model)
    own = {id(p) for p in model.parameters()}
    plain = type(opt) is torch.optim.AdamW and all(id(p) in own for g in opt.param_groups for p in g["params"])
    model, opt = partir_torch.auto_shard(model, inputs, "batch=2", loss_fn=loss_fn, optimizer=opt, plan=plan)
    got = float(partir_torch.step(model, opt, *inputs))
    for _ in range(2):
        loss = loss_fn(ref, *inputs)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return plain, got, float(loss.detach())


def test_the_returned_optimizer_survives_unshard_and_shards_again_with_its_state(two):
    for plain, got, want in two.run(reshard_case):
        assert plain and got == pytest.approx(want, rel=1e-6)  # (the zoo GPT casts its softmax to float32)
