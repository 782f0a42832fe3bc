"""The `partir-torch` command line."""

from __future__ import annotations

import json

import pytest

from partir_torch import cli
from partir_torch.cli import main

FACTORY = '''
import torch, torch.nn as nn
def make(width="8"):
    w = int(width)
    model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 1))
    return model, (torch.randn(4, w), torch.randn(4, 1)), loss
def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()
'''


def test_capture_json_for_a_zoo_model(capsys):
    assert main(["capture", "tiny-gpt2", "--config", "layers=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ops"] > 0 and isinstance(out["capture_time_s"], float)
    assert out["params"] > 0 and out["param_bytes"] == 4 * out["params"]
    assert len(out["groups"]) == 12 and all(isinstance(m, str) for g in out["groups"] for m in g)
    assert sum("h.2.attn.c_attn.weight" in g for g in out["groups"]) == 1  # three layers now


def test_capture_table_for_a_factory_file(tmp_path, capsys):
    f = tmp_path / "mine.py"
    f.write_text(FACTORY)
    assert main(["capture", f"{f}:make", "--config", "width=16", "--optimizer", "sgd"]) == 0
    text = capsys.readouterr().out
    assert "optimizer sgd" in text and "aten.addmm.default" in text and "parameters: 289" in text


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["capture", "no-such-model"], "no-such-model"),
        (["capture", "tiny-gpt2", "--config", "depth=2"], "depth"),
        (["capture", "tiny-gpt2", "--config", "layers"], "key=value"),
        (["capture", "missing.py:make"], "no file"),
    ],
)
def test_bad_model_arguments_are_named(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_coverage_json(capsys):
    assert main(["coverage", "tiny-llama", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["missing"] == [] and out["ops"]["aten.mm.default"] == "matrix.mm"
    assert out["covered"] == out["total"] == len(out["ops"])


def test_simulate_json(capsys):
    argv = ["simulate", "tiny-mlp", "--mesh", "batch=2,model=4", "--schedule", "batch:BatchParallel;model:Megatron",
            "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_abs_diff"] <= 1e-5 and out["mesh"] == {"batch": 2, "model": 4}
    kinds = {(c["kind"], c["axis"]) for c in out["collectives"]}
    assert ("all-reduce", "batch") in kinds and ("all-reduce", "model") in kinds
    assert out["params"]["layers.0.fc1.weight"] == ["model", None]
    assert out["exact"] and out["max_rel_diff"] <= out["tolerance"] and out["fp64_rel_diff"] is None


def test_simulate_tells_fp32_rounding_from_a_wrong_plan_by_the_fp64_step(tmp_path, capsys):
    """A user's conv net whose BatchNorms see inputs far from zero over 2 samples a device: fp32 lands ~4e-2
    from unsharded (cancellation in the variance), above the tolerance; the same plan on the step captured in
    fp64 is exact (torchvision's MobileNetV3 and ResNet-18 read 3e-5 / 6e-5 in fp32, ~1e-13 in fp64)."""
    (tmp_path / "bn.py").write_text(
        "import torch, torch.nn as nn\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    net = nn.Sequential(nn.Conv2d(3, 16, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 1),\n"
        "                        nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16, 10))\n"
        "    x, y = torch.randn(4, 3, 1, 1) * 0.01 + 30, torch.randint(0, 10, (4,))\n"
        "    return net, (x, y), lambda m, x, y: nn.functional.cross_entropy(m(x), y)\n")
    argv = ["simulate", f"{tmp_path / 'bn.py'}:make", "--mesh", "batch=2,model=2", "--schedule",
            "batch:BatchParallel;model:Megatron", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_rel_diff"] > out["tolerance"], out["max_rel_diff"]
    assert out["fp64_rel_diff"] is not None and out["fp64_rel_diff"] <= 1e-9 and out["exact"], out


def test_simulate_bad_schedule_is_named(capsys):
    assert main(["simulate", "tiny-mlp", "--mesh", "batch=2", "--schedule", "model:Megatron"]) == 2
    assert "names axis 'model'" in capsys.readouterr().err


def test_simulate_a_saved_searched_plan(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "tiny-mlp", "--mesh", "batch=2,model=2", "--schedule", "batch:BatchParallel;model:Auto",
                 "--budget", "20", "--memory", "27KB", "--out", str(plan), "--json"]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert main(["simulate", "tiny-mlp", "--plan", str(plan), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_abs_diff"] <= 1e-5 and out["mesh"] == {"batch": 2, "model": 2}
    assert out["params"] == saved["params"]  # the plan simulated is the plan saved
    assert any("model" in str(s) for s in out["params"].values())  # and it shards the model axis


def test_simulate_a_saved_zero_plan_and_one_that_does_not_fit(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "tiny-mlp", "--mesh", "batch=2", "--schedule", "batch:FSDP", "--out", str(plan),
                 "--json"]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert main(["simulate", "tiny-mlp", "--plan", str(plan), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_abs_diff"] <= 1e-5 and out["params"] == saved["params"]
    assert "reduce-scatter" in out["comm_bytes"] or "all-gather" in out["comm_bytes"]
    assert main(["simulate", "tiny-mlp", "--config", "width=32", "--plan", str(plan)]) == 2
    assert "the plan was made for" in capsys.readouterr().err
    assert main(["simulate", "tiny-mlp", "--plan", str(plan), "--mesh", "batch=4"]) == 2
    assert "the plan is for mesh {'batch': 2}" in capsys.readouterr().err


def test_simulate_needs_exactly_one_of_schedule_and_plan(tmp_path, capsys):
    assert main(["simulate", "tiny-mlp", "--mesh", "batch=2"]) == 2
    assert "--schedule TEXT, or --plan FILE" in capsys.readouterr().err
    assert main(["simulate", "tiny-mlp", "--plan", str(tmp_path / "none.json")]) == 2
    assert "cannot read a plan" in capsys.readouterr().err


def test_simulate_auto_with_a_budget(capsys):
    argv = ["simulate", "tiny-mlp", "--mesh", "batch=2,model=2", "--schedule", "*:Auto", "--json"]
    assert main([*argv, "--budget", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["max_abs_diff"] <= 1e-5
    assert main([*argv, "--budget", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_simulate_a_saved_plan_replays_its_decisions(tmp_path, capsys):
    """A searched plan with ZeRO-3 moves (fences) and tiles whose order decides propagation: `simulate --plan`
    replays the saved decisions and runs exactly the state that was costed (its digest), which gives back every
    saved spec."""
    from partir_torch import models
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir import Mesh
    from partir_torch.plan import ShardingPlan
    from partir_torch.propagate import ShardingState
    from partir_torch.rules.decompose import prepare
    from partir_torch.search.space import apply_action, parse_action

    actions = ["tile(h.*.mlp.c_fc.weight, 0, batch)", "tile(inputs[0], 0, model)", "tile(inputs[0], 0, batch)",
               "zero3(*, -1, 'model')", "zero3(wte.weight, 0, 'batch')"]
    net, inputs, loss_fn = models.build("tiny-gpt2", {"batch": "8"}, device="meta")
    program = capture(net, inputs, loss_fn, "adamw")
    state = ShardingState(prepare(program), Mesh.parse("batch=2,model=4"))
    assert all(apply_action(state, parse_action(a)) for a in actions)
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), schedule="*:Auto")
    assert plan.decisions == actions and plan.to_state(program).digest() == state.digest()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["simulate", "tiny-gpt2", "--config", "batch=8", "--plan", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_abs_diff"] <= 1e-5 and out["params"] == plan.params


def test_the_cli_offers_every_optimizer_capture_traces():
    from partir_torch.capture.optim import CLASSES

    assert sorted(CLASSES) == sorted(cli.OPTIMIZERS)


@pytest.mark.parametrize("command", ["plan", "train"])
def test_the_cli_searches_the_python_default_budget(command):
    """An episode budget by default, as `search` / `auto_shard`: the same plan on every run (a time budget
    would make the CLI's plan depend on the machine's speed)."""
    from partir_torch.search.budget import DEFAULT_EPISODES, Budget

    args = cli.build_parser().parse_args([command, "tiny-mlp", "--mesh", "batch=8"])
    assert Budget.parse(args.budget) == Budget(DEFAULT_EPISODES, None)
    assert f"{DEFAULT_EPISODES} episodes" in cli.build_parser()._subparsers._group_actions[0].choices[
        command].format_help()


def test_train_takes_plan_s_fallback_flag():
    args = cli.build_parser().parse_args(["train", "tiny-mlp", "--mesh", "batch=8", "--fallback"])
    assert args.fallback is True


def test_plan_takes_the_steps_options_and_says_them(capsys):
    """`plan`'s loop flags (mixed precision, remat, accumulation) shape the step it plans, as `auto_shard`'s do;
    the table says which step the plan is for."""
    argv = ["plan", "tiny-gpt2", "--mesh", "batch=2", "--budget", "20", "--no-cache", "--param-dtype", "bf16",
            "--reduce-dtype", "float32", "--remat", "full", "--accumulate", "2"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "step: accumulate=2, param_dtype=bfloat16, reduce_dtype=float32, remat=full" in text
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["loop"] == {"accumulate": 2, "param_dtype": "bfloat16", "reduce_dtype": "float32", "remat": "full",
                            "max_grad_norm": None, "max_grad_value": None}
