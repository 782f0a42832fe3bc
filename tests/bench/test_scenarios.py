"""`partir-torch bench` (`partir_torch/bench/scenarios.py`): the search against every expert of a scenario, written as a
table and a chart."""

from __future__ import annotations

import matplotlib.image
import numpy as np
import pytest

from partir_torch.bench import SCENARIOS, experts
from partir_torch.cli import main


def test_bench_writes_the_table_and_a_chart_per_scenario(tmp_path, capsys):
    assert main(["bench", "--only", "S7", "--episodes", "40", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "S7: found" in printed and "x the best expert" in printed
    md = (tmp_path / "benchmarks.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| S7 |"))
    cells = [c.strip() for c in row.split("|")]
    found, best, ratio = float(cells[3]), float(cells[4].split()[-1]), float(cells[5].split()[0])
    assert abs(found / best - ratio) < 1e-3 and cells[4].split()[0] in experts(["batch"])
    assert ("simplicity margin" in cells[5]) == (1.0 < ratio <= 1.005)  # a ratio the margin explains says so
    assert all(f"`{s}`" in md for s in experts(["batch"]).values())  # every expert's row
    img = matplotlib.image.imread(tmp_path / "bench-S7.png")
    assert img.shape[0] > 200 and len(np.unique(img[..., :3].reshape(-1, 3).round(2), axis=0)) > 5


def test_bench_names_the_scenarios_when_one_is_unknown(capsys):
    assert main(["bench", "--only", "S9"]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario(s) ['S9']" in err and all(s in err for s in SCENARIOS)


@pytest.mark.filterwarnings("ignore:ExpertParallel")
def test_the_experts_of_a_three_axis_mesh_with_a_slow_axis_apply_and_differ():
    from partir_torch.capture import capture
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.tactics import apply_schedule
    from partir_torch.workload import load

    mesh, dcn = parse_mesh("node=2:dcn,batch=2,model=2")
    got = experts(list(mesh.names), dcn)
    # the slow axis is data parallel in the hierarchical forms, the fast batch axis sharded, the last axis models
    assert got["DPxFSDPxMegatron"] == "model:Megatron;node:DP;batch:FSDP"
    assert got["MegatronxDP+ZeRO-1"].endswith("batch:ZeRO(1)") and "node:ZeRO" not in got["MegatronxDP+ZeRO-1"]
    assert "HSDPxMegatron" not in got and experts(["a", "b", "m"])["HSDPxMegatron"] == "m:Megatron;a,b:HSDP"
    model, inputs, loss_fn = load("tiny-llama", {"batch": "8"}, device="meta")
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    plans = {name: apply_schedule(program, mesh, s).digest() for name, s in got.items()}
    # on a Llama, sequence parallelism and FSDP change the plan of Megatron x DP; expert parallelism does not
    assert len({plans[k] for k in ("MegatronxDP", "MegatronSPxDP", "MegatronxFSDP", "DPxFSDPxMegatron")}) == 4
    assert plans["EPxDP"] == plans["DP"]
