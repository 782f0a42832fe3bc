"""Requests that cannot be met are never silent: each one warns or raises, saying what blocks it and what
would help."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch
import torch.nn as nn

from partir_torch.capture import capture
from partir_torch.cli import main
from partir_torch.errors import CaptureError, PartirError
from partir_torch.ir import Mesh
from partir_torch.search import Budget
from partir_torch.search.mcts import DEFAULT_EPISODES
from partir_torch.tactics import apply_schedule
from partir_torch.workload import load


def _mlp(batch: int = 4):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    return m, (torch.randn(batch, 8),), lambda mod, x: mod(x).square().mean()


def test_a_batch_the_axis_does_not_divide_warns_with_the_sizes():
    m, x, fn = _mlp(batch=3)
    p = capture(m, x, fn, "sgd")
    with pytest.warns(UserWarning, match=r"BatchParallel on 'batch' changes nothing: inputs\[0\] dim 0 has size 3, "
                                         r"not divisible by 2.*e\.g\. 4"):
        apply_schedule(p, Mesh.parse("batch=2"), "batch:BatchParallel")


def test_megatron_that_finds_no_pair_warns():
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    p = capture(m, (torch.randn(4, 8),), lambda mod, x: mod(x).sum(), "sgd")
    with pytest.warns(UserWarning, match=r"Megatron on 'model' changes nothing: no column/row pair"):
        apply_schedule(p, Mesh.parse("model=2"), "model:Megatron")


def test_a_tactic_with_nothing_to_shard_warns():
    m, x, fn = _mlp()
    p = capture(m, x, fn, torch.optim.SGD(m.parameters(), lr=0.1))  # no momentum: no optimizer state
    with pytest.warns(UserWarning, match=r"ZeRO on 'batch' changes nothing"):
        apply_schedule(p, Mesh.parse("batch=2"), "batch:BatchParallel;batch:ZeRO(1)")


def test_a_plan_that_shards_as_asked_does_not_warn():
    m, x, fn = _mlp()
    p = capture(m, x, fn, "adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_schedule(p, Mesh.parse("batch=2,model=2"), "batch:BatchParallel;model:Megatron")


def test_a_schedule_whose_axis_order_makes_reads_gather_whole_warns_with_the_order_that_does_not():
    m, x, fn = _mlp(batch=8)
    p = capture(m, x, fn, "adamw")
    mesh = Mesh.parse("fsdp=2,model=2")
    with pytest.warns(UserWarning, match=r"axis order: .*held tiled by 'fsdp' ahead of 'model' on a dim but read with "
                                         r"'model' further ahead \(0\.weight held P\(\('fsdp', 'model'\), None\) read "
                                         r"P\('model', None\).*apply the tactic that tiles 'model' before the one "
                                         r"that tiles 'fsdp'"):
        apply_schedule(p, mesh, "fsdp:FSDP;model:Megatron")
    with warnings.catch_warnings():  # the order the warning asks for: reads gather 'fsdp' alone
        warnings.simplefilter("error")
        apply_schedule(p, mesh, "model:Megatron;fsdp:FSDP")


@pytest.mark.parametrize("budget", [0, -3, "0", "0s", Budget(episodes=0)])
def test_a_budget_that_is_not_positive_is_an_error(budget):
    with pytest.raises(PartirError, match="must be positive"):
        Budget.parse(budget)


def test_cli_budget_zero_is_an_error(capsys):
    assert main(["plan", "tiny-mlp", "--mesh", "batch=2", "--budget", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_auto_without_a_budget_is_bounded_by_the_default():
    m, x, fn = _mlp()
    p = capture(m, x, fn, "adamw")
    assert Budget() == Budget.parse(None) == Budget(episodes=DEFAULT_EPISODES)
    t = time.perf_counter()
    state = apply_schedule(p, Mesh.parse("batch=2"), "batch:Auto")  # no SearchConfig: used to never end
    assert time.perf_counter() - t < 120 and state is not None


def test_no_loss_fn_is_an_error_unless_inference_is_asked_for():
    m, x, _ = _mlp()
    with pytest.raises(CaptureError, match=r"no loss_fn.*mode='inference'"):
        capture(m, x, None, "adamw")
    assert capture(m, x, None, None, mode="inference").mode == "inference"


def test_config_values_reach_a_factory_typed(tmp_path):
    f = tmp_path / "typed.py"
    f.write_text(
        "import torch, torch.nn as nn\n"
        "def make(width=8, scale=1.0, bias=True, name='x', extra=None):\n"
        "    assert isinstance(width, int) and isinstance(scale, float) and isinstance(bias, bool), \\\n"
        "        (width, scale, bias)\n"
        "    assert isinstance(name, str) and extra == 3\n"
        "    m = nn.Linear(width, 1, bias=bias)\n"
        "    return m, (torch.randn(2, width),), lambda mod, x: mod(x).sum() * scale\n"
    )
    m, _, _ = load(f"{f}:make", {"width": "4", "scale": "2", "bias": "false", "name": "7", "extra": "3"})
    assert m.in_features == 4 and m.bias is None
    with pytest.raises(PartirError, match=r"must be int"):
        load(f"{f}:make", {"width": "four"})
    with pytest.raises(PartirError, match=r"takes width, scale, bias, name, extra"):
        load(f"{f}:make", {"depth": "2"})


def test_cli_plan_fallback(tmp_path, capsys):
    f = tmp_path / "odd.py"
    f.write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        h = self.fc(x)\n"
        "        return torch.cdist(h, h)\n"
        "def make():\n"
        "    return M(), (torch.randn(4, 8),), lambda m, x: m(x).sum()\n"
    )
    argv = ["plan", f"{f}:make", "--mesh", "batch=2", "--schedule", "batch:BatchParallel", "--json"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "aten._cdist_forward.default" in err and "odd.py:7" in err  # plan captures without source lines,
    # then again with them for the error
    with pytest.warns(UserWarning, match=r"aten\._cdist_forward\.default \(1 op\(s\), module <root> \(odd\.py:7\)\)"):
        assert main([*argv, "--fallback"]) == 0
    assert main(["coverage", f"{f}:make", "--json"]) == 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["missing"][0]["op"] == "aten._cdist_backward.default"


def test_search_fallback_warns_per_op_and_plans():
    from partir_torch.search import search

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return torch.cdist(h, h)

    torch.manual_seed(0)
    args = (M(), (torch.randn(4, 8),), {"batch": 2})
    kw = {"loss_fn": lambda m, x: m(x).sum(), "schedule": "batch:BatchParallel", "budget": 5}
    with pytest.raises(PartirError, match=r"(?s)aten\._cdist_forward\.default.*fallback=True"):
        search(*args, **kw)
    with pytest.warns(UserWarning, match=r"no tile-mapping rule for aten\._cdist_forward\.default .*all-gather"):
        plan = search(*args, **kw, fallback=True)
    assert plan.to_json()["inputs"]


@pytest.mark.parametrize(("x", "torch_says"), [
    (torch.randint(0, 5, (4, 8)), "mat1 and mat2 must have the same dtype, but got Long and Float"),
    (torch.randn(4, 8, dtype=torch.float64), "mat1 and mat2 must have the same dtype, but got Double and Float"),
])
def test_a_step_torch_rejects_fails_at_capture_with_torchs_message(x, torch_says):
    m = nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match=torch_says):  # what eager torch says
        m(x)
    with pytest.raises(CaptureError,
                       match=rf"torch rejects this step: {torch_says} \(op aten\.addmm\.default.*x\.float\(\)"):
        capture(m, (x,), lambda mod, x: mod(x).sum(), "sgd")


def test_a_time_budget_too_small_for_an_episode_warns_with_the_episodes_run(capsys):
    with pytest.warns(UserWarning, match=r"search budget 0\.001 s is too small for this program: the search ran \d+ "
                                         r"episode\(s\)"):
        assert main(["plan", "tiny-mlp", "--mesh", "batch=2,model=2", "--budget", "1ms", "--json"]) == 0


def test_a_sufficient_time_budget_does_not_warn():
    m, x, fn = _mlp()
    p = capture(m, x, fn, "adamw")
    from partir_torch.search import SearchConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_schedule(p, Mesh.parse("batch=2"), "batch:Auto", search=SearchConfig(budget=Budget(seconds=2.0)))


def test_simulate_with_auto_and_no_budget_ends(capsys):
    t = time.perf_counter()
    assert main(["simulate", "tiny-mlp", "--mesh", "batch=2,model=2", "--schedule", "*:Auto", "--json"]) == 0
    assert time.perf_counter() - t < 120
    assert json.loads(capsys.readouterr().out)["max_abs_diff"] <= 1e-5
