"""Blocked axes said, not hidden (`search/blocked.py`): the dims that keep a mesh axis from splitting the step,
in the plan's table, its JSON and a warning of `search()`; on zoo models and on small models with other names."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cli import main
from partir_torch.ir import Mesh
from partir_torch.plan import ShardingPlan
from partir_torch.search import search
from partir_torch.search.blocked import blocked_axes
from partir_torch.tactics import apply_schedule


def _search(model, inputs, loss_fn, mesh, **kw) -> tuple[ShardingPlan, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = search(model, inputs, mesh, loss_fn=loss_fn, budget=kw.pop("budget", 6), cache=False, **kw)
    return plan, [str(w.message) for w in caught]


def test_a_batch_the_data_axes_do_not_divide_is_said_with_the_fix():
    """The issue's case at tiny size: a batch of 2 on a 3-D mesh whose two batch-like axes are 4-way."""
    model, inputs, loss_fn = models.build("tiny-llama", {"batch": "2"}, device="meta")
    plan, warned = _search(model, inputs, loss_fn, "data=4,fsdp=4,model=2")
    texts = [b["text"] for b in plan.blocked]
    for axis in ("data", "fsdp"):
        assert any(t.startswith("the batch (dim 0 of inputs 0 [2, 16], 1 [2, 16]) has size 2, not divisible by "
                                f"{axis}=4: no data parallelism over '{axis}'; make it a multiple of 4 (e.g. 4) "
                                f"or shrink '{axis}' to 2") for t in texts), texts
    assert any("'data' and 'fsdp' together need a multiple of 16" in t for t in texts)
    table = plan.table()
    assert "blocked: the batch (dim 0 of inputs 0 [2, 16], 1 [2, 16]) has size 2, not divisible by data=4" in table
    assert {b["axis"] for b in plan.to_json()["blocked"]} >= {"data", "fsdp"}
    assert ShardingPlan.from_json(plan.to_json()).blocked == plan.blocked
    assert any("keep mesh axes from splitting the step" in w and "data=4" in w for w in warned)


def test_a_batch_that_divides_is_not_reported():
    model, inputs, loss_fn = models.build("tiny-llama", {"batch": "8"}, device="meta")
    plan, _ = _search(model, inputs, loss_fn, "data=4,model=2")
    assert not [b for b in plan.blocked if b["what"].startswith("dim 0 of input")], plan.blocked


def test_heads_the_model_axis_does_not_divide_are_said():
    """GPT with 2 heads on a 4-way model axis: the attention's linears divide, the heads they split into do not.
    (Width 256: wide enough that model parallelism pays over the bucketed gradient reduction.)"""
    model, inputs, loss_fn = models.build("tiny-gpt2", {"heads": "2", "width": "256"}, device="meta")
    plan, _ = _search(model, inputs, loss_fn, "batch=2,model=4")
    heads = [b for b in plan.blocked if b["axis"] == "model" and "stops at" in b["text"]]
    assert heads, plan.blocked
    b = heads[0]
    assert b["size"] == 2 and b["divisor"] == 4 and b["where"] == "h.*.attn" and b["shape"][2] == 2
    assert "has size 2, not divisible by model=4; make it a multiple of 4 (e.g. 4) or shrink 'model' to 2" in b["text"]
    model, inputs, loss_fn = models.build("tiny-gpt2", {"heads": "4", "width": "256"}, device="meta")
    plan, _ = _search(model, inputs, loss_fn, "batch=2,model=4")
    assert not plan.blocked, plan.blocked


def test_a_manual_split_that_propagation_stops_is_said():
    """Megatron on a model axis the head count does not divide: the plan's own split stops at the heads."""
    model, inputs, loss_fn = models.build("tiny-gpt2", {"heads": "2"}, device="meta")
    program = capture(model, inputs, loss_fn, "adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = apply_schedule(program, Mesh.parse("batch=2,model=4"), "batch:BatchParallel;model:Megatron")
    texts = [b["text"] for b in blocked_axes(state)]
    assert any(t.startswith("the plan's split") and "over 'model' stops at" in t and "size 2, not divisible by "
               "model=4" in t for t in texts), texts


class Grouped(nn.Module):
    """Features split into groups by a view (heads by another name), between two projections."""

    def __init__(self, width: int = 12, groups: int = 3) -> None:
        super().__init__()
        self.encode = nn.Linear(width, width)
        self.decode = nn.Linear(width, width)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        h = h.view(h.shape[0], self.groups, -1).softmax(-1).reshape(h.shape[0], -1)
        return self.decode(h)


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 7)
        self.second = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def test_groups_an_axis_does_not_divide_are_said_on_a_model_with_other_names():
    plan, warned = _search(Grouped(), (torch.randn(8, 12), torch.randn(8, 12)), mse, "rows=2,cols=4")
    b = next(b for b in plan.blocked if b["axis"] == "rows")
    assert b["size"] == 3 and b["shape"] == [8, 3, 4] and "encode.weight" in b["text"]
    assert "has size 3, not divisible by rows=2; make it a multiple of 2 (e.g. 4) or leave 'rows' out" in b["text"]
    assert any("not divisible by rows=2" in w for w in warned)
    plan, _ = _search(Grouped(groups=4), (torch.randn(8, 12), torch.randn(8, 12)), mse, "rows=2,cols=2")
    assert not plan.blocked, plan.blocked


def test_an_axis_that_already_splits_a_parameters_work_is_not_reported_for_it():
    """Batch-parallel over `rows`: every projection's work is split there, so the groups that would stop a
    feature split over `rows` block nothing."""
    plan, _ = _search(Grouped(), (torch.randn(8, 12), torch.randn(8, 12)), mse, "rows=2", schedule="rows:DP")
    assert plan.inputs[0][0] == "rows" and plan.blocked == []


def test_a_config_no_axis_divides_says_which_dims_block_which_axes():
    """Nothing divides: the search replicates everything, and says why instead of staying silent."""
    plan, warned = _search(Odd(), (torch.randn(3, 5), torch.randn(3, 3)), mse, "rows=2,cols=2")
    assert not any(any(s) for s in plan.params.values())
    for axis in ("rows", "cols"):
        texts = [b["text"] for b in plan.blocked if b["axis"] == axis]
        assert any(t.startswith(f"the batch (dim 0 of inputs 0 [3, 5], 1 [3, 3]) has size 3, not divisible by {axis}=2")
                   for t in texts), texts
        assert f"no dim of parameters first.weight [7, 5], first.bias [7], second.weight [3, 7], second.bias [3] is " \
               f"divisible by {axis}=2, so they cannot be split over '{axis}'" in " ".join(texts)
    assert len(warned) == 1 and "keep mesh axes from splitting the step" in warned[0]


def test_cli_plan_prints_the_blocked_dims(capsys):
    assert main(["plan", "tiny-gpt2", "--config", "batch=2", "--mesh", "batch=4,model=2", "--budget", "6",
                 "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "blocked: the batch (dim 0 of inputs 0 [2, 16], 1 [2, 16]) has size 2, not divisible by" in out


@pytest.mark.parametrize("mesh", ["batch=2,model=4"])
def test_a_good_configuration_reports_nothing(mesh):
    model, inputs, loss_fn = models.build("tiny-gpt2", {"width": "256"}, device="meta")
    plan, warned = _search(model, inputs, loss_fn, mesh)
    assert plan.blocked == [] and not [w for w in warned if "keep mesh axes" in w]


def test_a_busy_axis_is_not_blamed_on_the_batch_when_another_axis_splits_it():
    """Batch 4 on batch=2 x model=4 under DP and Megatron: the batch is split, `model` does model parallelism."""
    model, inputs, loss_fn = models.build("tiny-gpt2", {"batch": "4"}, device="meta")
    plan, _ = _search(model, inputs, loss_fn, "batch=2,model=4", schedule="batch:BatchParallel;model:Megatron")
    assert plan.inputs[0][0] == "batch" and plan.blocked == [], plan.blocked


def test_a_busy_axis_is_said_when_nothing_splits_the_batch():
    model, inputs, loss_fn = models.build("tiny-gpt2", {"batch": "2"}, device="meta")
    plan, _ = _search(model, inputs, loss_fn, "batch=4,model=4", schedule="model:Megatron")
    b = next(b for b in plan.blocked if b["axis"] == "model" and b["what"].startswith("dim 0 of input"))
    assert "not divisible by model=4" in b["text"] and "of the step's FLOPs over 'model' otherwise" in b["text"]


def test_parameters_stored_split_on_the_axis_are_not_reported():
    """ZeRO-3 on `rows` stores every parameter split there (the norm's work is not split: the batch of 3
    blocks it, and its 6 features do not divide by rows x rows): only the batch is said."""
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 4))
    plan, _ = _search(model, (torch.randn(3, 4), torch.randn(3, 4)), mse, "rows=2", schedule="rows:ZeRO(3)")
    assert all("rows" in json for json in map(str, plan.params.values()))
    assert [b["what"] for b in plan.blocked] == ["dim 0 of inputs 0 [3, 4], 1 [3, 4]"], plan.blocked
