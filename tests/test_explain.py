"""`explain` attributes the report's communication to causes (the rows add up to the report); `diff` compares
two saved plans."""

from __future__ import annotations

import json

import pytest

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cli import main
from partir_torch.cost import evaluate, hardware
from partir_torch.explain import collapse, diff, explain
from partir_torch.ir import Mesh
from partir_torch.plan import ShardingPlan
from partir_torch.tactics import apply_schedule

MESH = Mesh.parse("batch=2,model=4")


def _state(name, schedule, *, fold=False, layers=None):
    net, inputs, loss_fn = models.build(name, {"layers": layers} if layers else None, device="meta")
    program = capture(net, inputs, loss_fn, "adamw", fold=fold)
    return apply_schedule(program, MESH, schedule)


def test_collapse_reads_repeated_layers_as_one():
    assert collapse("h.11.attn.c_attn.weight") == "h.*.attn.c_attn.weight"
    assert collapse("opt.exp_avg[layers.3.fc1.weight]") == "opt.exp_avg[layers.*.fc1.weight]"
    assert collapse("wte.weight") == "wte.weight"


@pytest.mark.parametrize("fold", [False, True])
def test_explain_rows_add_up_to_the_report(fold):
    """Folded or not, the causes account for every byte and second of the report's communication."""
    hw = hardware("tpu-v5e")
    state = _state("tiny-gpt2", "batch:BatchParallel;model:Megatron;batch:ZeRO(1)", fold=fold, layers=4)
    report = evaluate(state, hw, dcn_axes=frozenset({"batch"}))
    ex = explain(state, report, hw, dcn_axes=frozenset({"batch"}))
    for kind, by_axis in report.comm_bytes.items():
        for axis, nbytes in by_axis.items():
            assert sum(r.bytes for r in ex.comm if r.kind == kind and r.axis == axis) == nbytes
    assert sum(r.time_s for r in ex.comm) == pytest.approx(report.comm_time_s, rel=1e-9)
    assert [r.time_s for r in ex.comm] == sorted((r.time_s for r in ex.comm), reverse=True)
    # the four layers are one cause each: counted 4 times, named with `*`
    qkv = [r for r in ex.comm if r.kind == "all-to-all"]
    assert qkv and all(r.count == 4 and "h.*.attn" in r.what for r in qkv)
    text = ex.table()
    assert "communication by cause" in text and "memory at the peak" in text


def test_explain_data_parallel_is_gradient_all_reduces():
    hw = hardware("cpu-virtual")
    state = _state("tiny-mlp", "batch:BatchParallel")
    ex = explain(state, evaluate(state, hw), hw)
    grads = [r for r in ex.comm if r.what.startswith("grad[")]
    assert grads and all(r.kind == "all-reduce" and r.axis == "batch" for r in grads)
    rest = [r for r in ex.comm if r.kind != "buckets"]
    assert {r.what for r in rest} - {r.what for r in grads} <= {"loss"}  # and the scalar loss
    # the gradients go in buckets: one row gives back the latency of the calls they save
    (saved,) = [r for r in ex.comm if r.kind == "buckets"]
    assert saved.axis == "batch" and saved.time_s < 0 and saved.bytes == 0
    assert sum(r.time_s for r in ex.comm) == pytest.approx(ex.comm_time_s, rel=1e-9)


def _plan(name, schedule, hw="cpu-virtual"):
    state = _state(name, schedule)
    return ShardingPlan.from_state(state, evaluate(state, hardware(hw)), schedule=schedule, hardware=hw)


def test_diff_of_a_plan_with_itself_and_with_another():
    dp, fsdp = _plan("tiny-gpt2", "batch:BatchParallel"), _plan("tiny-gpt2", "batch:FSDP")
    same = diff(dp, ShardingPlan.from_json(json.dumps(dp.to_json())))
    assert same.same_specs and all(a == b for a, b in same.cost.values())
    d = diff(dp, fsdp)
    # every parameter is sharded by FSDP; the two layers' copies collapse to one row
    assert sum(k for _, k, _, _ in d.params) == len(dp.params)
    assert ("h.*.attn.c_attn.weight", 2, [None, None], ["batch", None]) in d.params
    assert not d.optimizer_state and any("change as their parameters do" in n for n in d.notes)
    assert d.cost["step_time_s"] == (dp.cost["step_time_s"], fsdp.cost["step_time_s"])
    assert "parameters with another spec" in str(d)


def test_cli_diff(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", "tiny-mlp", "--mesh", "batch=2,model=4", "--schedule", "batch:BatchParallel",
                 "--out", str(a), "--explain"]) == 0
    assert "communication by cause" in capsys.readouterr().out
    assert main(["plan", "tiny-mlp", "--mesh", "batch=2,model=4", "--schedule", "batch:BatchParallel;model:Megatron",
                 "--out", str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(b), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] and out["cost"]["step_time_s"][0] != out["cost"]["step_time_s"][1]
    assert main(["diff", str(a), str(tmp_path / "missing.json")]) == 2
    assert "cannot read a plan from" in capsys.readouterr().err
