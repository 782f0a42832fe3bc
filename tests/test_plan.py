"""Sharding plans: JSON form and round trip, and `partir-torch plan` for manual schedules."""

from __future__ import annotations

import json

import pytest

from partir_torch import capture, models
from partir_torch.cli import main, parse_mesh
from partir_torch.cost import evaluate, hardware
from partir_torch.errors import PartirError
from partir_torch.ir import Mesh
from partir_torch.plan import ShardingPlan
from partir_torch.tactics import apply_schedule


def test_plan_json_round_trip():
    model, inputs, loss_fn = models.build("tiny-llama", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    st = apply_schedule(p, Mesh.parse("batch=2,model=4"), "batch:BatchParallel;model:Megatron;batch:ZeRO(1)")
    plan = ShardingPlan.from_state(st, evaluate(st, hardware("tpu-v5e")), schedule="x", hardware="tpu-v5e")
    d = plan.to_json()
    assert d["mesh"]["axes"] == {"batch": 2, "model": 4} and "search" not in d
    assert d["params"]["layers.0.self_attn.q_proj.weight"] == ["model", None]
    assert d["inputs"][0] == ["batch", None]
    assert d["optimizer_state"]["layers.0.mlp.down_proj.weight"]["exp_avg"] == ["batch", "model"]
    assert set(d["cost"]) >= {"step_time_s", "peak_memory_bytes", "comm_bytes"}
    assert ShardingPlan.from_json(json.dumps(d)).to_json() == d
    assert "parameters sharded" in plan.table()


def test_plan_cli_json_and_memory_override(capsys):
    argv = ["plan", "tiny-gpt2", "--mesh", "batch=2:dcn,model=4", "--hardware", "h100-sxm", "--memory", "1KiB",
            "--schedule", "batch:BatchParallel;model:Megatron", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mesh"] == {"axes": {"batch": 2, "model": 4}, "dcn": ["batch"]}
    assert d["cost"]["memory_limit"] == 1024 and d["cost"]["feasible"] is False
    assert d["cost"]["comm_bytes"]["all-reduce"] > 0


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--schedule", "batch:Auto(speed)"], "goals: time, communication"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--schedule", "model:Auto"], "names axis 'model'"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--budget", "soon"], "30s"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--hardware", "tpu-v9"], "presets: tpu-v4"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--memory", "lots"], "16GiB"),
        (["plan", "tiny-mlp", "--mesh", "batch=8:fast"], ":dcn"),
    ],
)
def test_plan_cli_errors(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_parse_mesh_marks_dcn_axes():
    mesh, dcn = parse_mesh("data=8:dcn,model=8")
    assert mesh.names == ("data", "model") and dcn == {"data"}
    with pytest.raises(PartirError):
        parse_mesh("data=8:nvme")
