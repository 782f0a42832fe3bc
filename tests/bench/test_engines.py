"""`bench/engines.py`: a zoo model's plans run through the engines and priced from what the engines moved."""

from __future__ import annotations

import pytest

from partir_torch.bench import engines
from partir_torch.launch import Workers


@pytest.fixture(scope="module")
def two():
    with Workers(2, timeout=300) as w:
        yield w


@pytest.mark.engine
def test_the_torch_backend_moves_what_each_plan_predicts_and_is_priced_as_predicted(two):
    # (on 2 devices no plan halves the replicated peak: the limit is 3/4 of it)
    row = engines.run_one("tiny-mlp", "batch=2", 20, ("torch",), two, log=lambda *_: None, memory=0.75)
    assert len(row["plans"]) >= 3 and not row["failed"]  # DP, FSDP, ZeRO, Megatron: several distinct plans
    for p in row["plans"]:
        m = p["measured"]["torch"]
        assert m["bytes_ratio"] == 1.0, (p["names"], m)
        for hw in engines.HARDWARE:  # the same collectives, so the same price: the pricing is the cost model's
            assert m["step_s"][hw] == pytest.approx(p["predicted"][hw]["step_s"], rel=1e-9), (p["names"], hw)
    for v in row["verdicts"]:
        assert v["found_fits"] and v["experts_fitting"] >= 1 and v["ratio"] > 0, v


def test_priced_collectives_cost_what_the_cost_model_says_on_fast_and_slow_axes():
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.lower import lower
    from partir_torch.tactics import apply_schedule
    from partir_torch.workload import load

    mesh, dcn = parse_mesh("batch=2:dcn,model=2")
    model, inputs, loss_fn = load("tiny-gpt2", {"batch": "4"}, device="meta")
    state = apply_schedule(capture(model, inputs, loss_fn, "adamw", fold=False), mesh,
                           "batch:DP;model:Megatron;batch:ZeRO(2)")
    from collections import Counter

    from partir_torch.lower.buckets import plan, reductions

    colls = lower(state)
    assert {c.kind for c in colls} >= {"all-reduce", "reduce-scatter", "all-gather"}
    for name in engines.HARDWARE:
        hw = hardware(name)
        # what the torch backend runs: `lower`'s collectives, a bucket's members in one call each bucket
        buckets = plan(reductions(state), int(hw.bucket_cap))
        members = Counter((m.step.kind, m.step.axis) for b in buckets for m in b.members)
        ran = [[b.kind, [b.axis], 1, b.nbytes] for b in buckets]
        for c in colls:
            if members[(c.kind, c.axis)]:
                members[(c.kind, c.axis)] -= 1
            else:
                ran.append([c.kind, [c.axis], 1, c.bytes])
        want = evaluate(state, hw, dcn_axes=dcn).comm_time_by_axis
        got = engines.priced(ran, dict(mesh.axes), hw, dcn)
        assert set(got) == set(want) and all(got[a] == pytest.approx(want[a], rel=1e-9) for a in want), (got, want)


def _row(found_measured: float, found_predicted: float, expert_peak: int) -> dict:
    def plan(names, predicted, measured, peak):
        return {"names": names, "predicted": {hw: {"step_s": predicted, "feasible": True, "peak": 900}
                                              for hw in engines.HARDWARE},
                "predicted_bytes": {"all-reduce": {"batch": 4096}},
                "measured": {"torch": {"step_s": dict.fromkeys(engines.HARDWARE, measured), "peak": peak,
                                       "collectives": [["all-reduce", ["batch"], 1, 8192]]}}}

    return {"engines": ["torch"], "limits": dict.fromkeys(engines.HARDWARE, 1000),
            "plans": [plan(["FSDP"], 2e-3, 2e-3, expert_peak), plan(["DP"], 3e-3, 3e-3, 900),
                      plan([f"found {hw}" for hw in engines.HARDWARE], found_predicted, found_measured, 500)]}


def test_a_slower_found_plan_says_why_and_an_expert_over_the_limit_is_not_the_bar():
    (v, *_) = engines.verdicts(_row(2.5e-3, 1e-3, 800))
    assert v["best"] == "FSDP" and v["ratio"] == pytest.approx(1.25)
    assert v["why"].startswith("predicted faster (1.000 vs 2.000 ms), measured slower: found ran all-reduce 8.0 KiB "
                               "where the plan has all-reduce 4.0 KiB")
    (v, *_) = engines.verdicts(_row(2.5e-3, 2.5e-3, 800))
    assert v["why"].startswith("predicted too")
    (v, *_) = engines.verdicts(_row(2.5e-3, 2.5e-3, 1200))  # FSDP measured over the limit: DP is the best that fits
    assert v["best"] == "DP" and v["ratio"] < 1 and "why" not in v and v["experts_fitting"] == 1
    row = _row(2.5e-3, 1e-3, 800)
    row["plans"][2]["measured"]["torch"]["peak"] = 2048  # the found plan over the limit as measured: said
    (v, *_) = engines.verdicts(row)
    assert not v["found_fits"] and v["memory"].startswith("the found plan measures 2 KiB, over the limit 1 KiB")
    del row["plans"][2]["measured"]["torch"]["step_s"]  # the found plan did not run: said, no ratio
    assert "ratio" not in engines.verdicts(row)[0] and "did not run" in engines.verdicts(row)[0]["why"]


@pytest.mark.xla
def test_torch_xla_runs_a_plan_and_its_own_auto_sharding_which_replicates_on_the_cpu():
    from partir_torch.cost import evaluate, hardware

    cands, _, replicated, _ = engines.plans("tiny-mlp", "batch=2", 10)
    dp = next(c for c in cands if "DP" in c.names)
    got = engines.run_xla("tiny-mlp", dp.plan)
    dp.measured["torch_xla"] = got
    assert abs(engines.bytes_ratio(dp, "torch_xla") - 1) <= engines.BYTES_BAR["torch_xla"], got
    auto = engines.run_xla_auto("tiny-mlp", dp.plan)
    assert "error" not in auto, auto
    # torch_xla 2.9's auto-sharding on the CPU: no collective, every device holds the whole step
    whole = evaluate(replicated, hardware("h100-sxm")).peak_memory_bytes
    assert auto["collectives"] == [] and auto["peak"] >= 0.9 * whole
