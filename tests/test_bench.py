"""`partir-torch bench` (`partir_torch/bench.py`): the search against every expert of a scenario, written as a
table and a chart."""

from __future__ import annotations

import matplotlib.image
import numpy as np

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
