"""The expert composites as search actions: each is the plan its tactics make, DCN axes take no per-layer
collectives, and the search's answer is never worse than the best composite."""

from __future__ import annotations

import pytest

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cost import evaluate, hardware
from partir_torch.ir.mesh import parse_mesh
from partir_torch.search import Auto, Budget, SearchConfig
from partir_torch.search.seeds import composites
from partir_torch.search.space import replay, state_slots
from partir_torch.tactics import apply_schedule

_WIDE = {"batch": "16", "seq": "1024", "width": "2048", "heads": "16", "kv_heads": "4", "ffn": "8192",
         "vocab": "32000"}
_TACTIC = {"dp": "DP", "fsdp": "FSDP", "zero1": "DP;{a}:ZeRO(1)", "megatron": "Megatron",
           "megatron_sp": "Megatron;{a}:SequenceParallel"}


@pytest.fixture(scope="module")
def llama():
    model, inputs, loss_fn = models.build("tiny-llama", _WIDE)
    return capture(model, inputs, loss_fn, "adamw", fold=True)


def _schedule(name: str) -> str:
    """`data:dp,model:megatron` as the tactics' schedule, Megatron first (the canonical order's)."""
    parts = [p.split(":") for p in name.split(",") if not p.endswith(":none")]  # (an axis left unused)
    parts.sort(key=lambda p: not p[1].startswith("megatron"))
    return ";".join(f"{a}:" + _TACTIC[r].format(a=a) for a, r in parts)


@pytest.mark.filterwarnings("ignore:axis order")  # two FSDP axes: the later one minor, as the tactics make it
def test_each_composite_is_the_plan_its_tactics_make(llama):
    mesh, dcn = parse_mesh("data=2:dcn,fsdp=2,model=2")
    root = apply_schedule(llama, mesh, [])
    got = composites(root, mesh.names, dcn)
    names = [n for n, _ in got]
    assert "data:dp,fsdp:fsdp,model:megatron" in names and "data:zero1,fsdp:megatron,model:fsdp" in names
    assert not any(f"data:{r}" in n for n in names for r in ("fsdp", "megatron"))  # the DCN axis: dp, zero1
    assert all(n.count("megatron") <= 1 and n.count(":none") <= 1 for n in names)
    assert "data:none,fsdp:fsdp,model:megatron" in names and "data:dp,fsdp:fsdp,model:megatron_sp" in names
    hw = hardware("tpu-v5p")
    for name, acts in got:
        plan = replay(root, acts)
        assert plan is not None, name
        expert = apply_schedule(llama, mesh, _schedule(name))
        assert plan.shard == expert.shard, name
        assert evaluate(plan, hw, dcn_axes=dcn).step_time_s == evaluate(expert, hw, dcn_axes=dcn).step_time_s


def test_a_group_too_small_for_a_slot_is_still_tiled_as_megatron_tiles_it():
    """Grouped-query attention with one k/v head: the k/v projections are far below a slot's share of the
    largest weight, yet Megatron (and so its composite) splits them; left whole they would cost every layer
    their compute on every device and an all-reduce of their gradient (L405 was 1.06 x the expert)."""
    model, inputs, loss_fn = models.build("tiny-llama", {**_WIDE, "kv_heads": "1", "batch": "4", "seq": "64"})
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    mesh, _ = parse_mesh("data=2,model=2")
    root = apply_schedule(program, mesh, [])
    assert not any("k_proj" in s.target for s in state_slots(root))
    got = dict(composites(root, mesh.names))
    for name in ("data:dp,model:megatron", "data:fsdp,model:megatron_sp"):
        plan = replay(root, got[name])
        assert plan is not None and plan.shard == apply_schedule(program, mesh, _schedule(name)).shard, name
        k = program.params["layers.0.self_attn.k_proj.weight"]
        assert plan.shard[k].dims[0][0] == "model", name


def test_chained_linears_grouped_as_repeats_still_give_a_megatron_composite():
    """GNS's MLPs are Sequentials of same-shaped linears, grouped as repeats although the pairs split them on
    two dims (column, then row): such a group stays whole, and the rest of Megatron replays (with the other
    axis data parallel, or unused)."""
    model, inputs, loss_fn = models.build("tiny-gns")
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    root = apply_schedule(program, parse_mesh("batch=2,model=4")[0], [])
    got = dict(composites(root, ("batch", "model")))
    for name in ("batch:dp,model:megatron", "batch:zero1,model:megatron", "batch:none,model:megatron"):
        plan = replay(root, got[name])
        assert plan is not None, name
        assert sum(bool(sh.axes) for sh in plan.shard) > 0


def test_a_short_search_is_never_worse_than_the_best_composite(llama):
    mesh, dcn = parse_mesh("data=2:dcn,fsdp=2,model=2")
    hw = hardware("tpu-v5p")
    root = apply_schedule(llama, mesh, [])
    best = min(evaluate(replay(root, acts), hw, dcn_axes=dcn).step_time_s
               for _, acts in composites(root, mesh.names, dcn))
    cfg = SearchConfig(hw, dcn, None, 0, Budget(episodes=5))
    got = evaluate(apply_schedule(llama, mesh, [Auto()], search=cfg), hw, dcn_axes=dcn)
    assert got.feasible and got.step_time_s <= best


def test_fsdp_over_dcn_is_a_start_only_when_nothing_else_fits(llama):
    mesh, dcn = parse_mesh("data=4:dcn,model=2")
    hw = hardware("tpu-v5p")
    root = apply_schedule(llama, mesh, [])
    light = composites(root, mesh.names, dcn)
    heavy = composites(root, mesh.names, dcn, over_dcn=True)
    assert heavy and all("data:fsdp" in n or "data:megatron" in n for n, _ in heavy)
    assert not {n for n, _ in heavy} & {n for n, _ in light}

    def peak(acts):
        return evaluate(replay(root, acts), hw, dcn_axes=dcn).peak_memory_bytes

    lo, hi = min(peak(a) for _, a in heavy), min(peak(a) for _, a in light)
    assert lo < hi  # FSDP across the DCN axis is what fits in less memory
    limit = (lo + hi) / 2
    cfg = SearchConfig(hw, dcn, limit, 0, Budget(episodes=5))
    got = evaluate(apply_schedule(llama, mesh, [Auto()], search=cfg), hw, dcn_axes=dcn, memory_limit=limit)
    assert got.feasible
