"""`bench/report.py`: what the benchmark page says of the engines' measurements."""

from __future__ import annotations

from partir_torch.bench.report import _xla_causes


def _plan(predicted: dict, ran: list, ratio: float) -> dict:
    return {"predicted_bytes": predicted, "measured": {"torch_xla": {"collectives": ran, "bytes_ratio": ratio}}}


def test_the_torch_xla_plans_outside_the_bar_are_counted_by_what_xla_ran_instead():
    rows = [{"plans": [
        _plan({"reduce-scatter": {"batch": 100}, "all-gather": {"batch": 100}},
              [["all-reduce", ["batch"], 2, 200], ["all-gather", ["batch"], 2, 100]], 1.5),
        _plan({"all-reduce": {"model": 100}, "all-to-all": {"model": 10}},
              [["all-reduce", ["model"], 1, 100], ["collective-permute", ["model"], 4, 40]], 1.3),
        _plan({"all-reduce": {"model": 100}}, [["all-reduce", ["model"], 1, 105]], 1.05),  # within the bar
        {"predicted_bytes": {}, "measured": {"torch": {"bytes_ratio": 1.0}}},  # not run on torch_xla
    ]}]
    said = _xla_causes(rows)
    assert said.startswith("Of the 2 torch_xla plans outside the bar")
    assert "1 run their reduce-scatters as all-reduces" in said
    assert "1 add collective-permutes" in said and "1 move other all-to-all bytes" in said
