"""The `partir-torch` command line."""

from __future__ import annotations

import json

import pytest

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
    argv = ["simulate", "tiny-mlp", "--mesh", "batch=2,model=4", "--schedule", "batch:BatchParallel;model:Megatron", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_abs_diff"] <= 1e-5 and out["mesh"] == {"batch": 2, "model": 4}
    kinds = {(c["kind"], c["axis"]) for c in out["collectives"]}
    assert ("all-reduce", "batch") in kinds and ("all-reduce", "model") in kinds
    assert out["params"]["layers.0.fc1.weight"] == ["model", None]


def test_simulate_bad_schedule_is_named(capsys):
    assert main(["simulate", "tiny-mlp", "--mesh", "batch=2", "--schedule", "model:Megatron"]) == 2
    assert "names axis 'model'" in capsys.readouterr().err
