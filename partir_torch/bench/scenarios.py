"""The scenarios: the search's plans against the strongest plans a practitioner would write, by the cost model.

S1-S7 (`benchmarks/search.py`) and the large scenarios of `benchmarks/scale.py` (L70, L70-8k, L8, L405).
Per scenario the model is captured once (folded), every applicable expert schedule (`experts`: DP, FSDP,
HSDP, ZeRO-1/2, Megatron, Megatron with sequence parallelism, context parallelism, expert parallelism, their
compositions with DP / FSDP, and on meshes with slow axes DP across them with FSDP inside) is costed, and
the search runs on the same program with an episode budget (the same plan on every run; 200, the CLI's
default); the row reads the found plan's predicted step time against the best expert that fits, and the
anytime curve the same ratio after smaller and larger budgets. The figures are the cost model's (calibrated
against XLA: docs/cost-model.md); `engines.py` runs the zoo's plans on the engines.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

# name: (model, overrides, hardware, mesh, dcn axes)
SCENARIOS: dict[str, tuple[str, dict[str, str], str, str, tuple[str, ...]]] = {
    "S1": ("gpt2-xl", {}, "tpu-v5e", "batch=2,model=4", ()),
    "S2": ("gpt-6.7b", {}, "h100-sxm", "batch=4,model=8", ("batch",)),
    "S3": ("llama-7b", {"batch": "16"}, "tpu-v5p", "data=8,model=8", ()),
    "S4a": ("unet", {}, "tpu-v4", "batch=8", ()),
    "S4b": ("unet", {}, "tpu-v4", "batch=4,model=2", ()),
    "S5": ("gns", {}, "tpu-v4", "batch=2,model=4", ()),
    "S6": ("moe", {}, "h100-sxm", "batch=2,expert=8", ("batch",)),
    "S7": ("mlp", {"batch": "65536", "width": "64", "hidden": "256"}, "cpu-virtual", "batch=8", ()),
}
# the large scenarios of benchmarks/scale.py (":dcn" marks the slow axes; the last axis is the model axis)
LARGE: dict[str, tuple[str, dict[str, str], str, str, tuple[str, ...]]] = {
    "L70": ("llama2-70b", {}, "tpu-v5p", "data=16:dcn,fsdp=16,model=8", ()),
    "L70-8k": ("llama2-70b", {"batch": "1024"}, "tpu-v5p", "pod=4:dcn,data=16:dcn,fsdp=16,model=8", ()),
    "L8": ("llama3-8b", {}, "h100-sxm", "data=8:dcn,model=8", ()),
    "L405": ("llama3-405b", {}, "tpu-v5p", "pod=4:dcn,data=8:dcn,fsdp=16,model=16", ()),
}
ALL = SCENARIOS | LARGE
# L405 as trained fits no expert in 95 GiB, not even with full activation checkpointing (`benchmarks/remat.py`,
# where the search with it fits): its limit is lifted here
MEMORY = {"L405": "4TiB"}
QUICK = ("S1", "S2", "S3", "S5", "S6", "S7", "L8")  # (the U-Net's captures take most of a full run's time)
ANYTIME = (25, 50, 100, 200, 400)  # the episode budgets of the anytime curve
SIMPLICITY = 0.005  # the MCTS's and local search's margin (`mcts.MCTS(simplicity=...)`)


def experts(axes: list[str], dcn: frozenset[str] | set[str] = frozenset(), model: str | None = None
            ) -> dict[str, str]:
    """The expert schedules a practitioner would write for these axes: `model` (the last axis unless named)
    is the model-parallel one, the others batch axes, those in `dcn` slow (data parallel across them, the
    sharded forms on the fast ones). An expert a model cannot take (expert parallelism without stacked experts)
    changes nothing and costs what the plan without it does."""
    if len(axes) == 1:
        (b,) = axes
        return {"DP": f"{b}:DP", "FSDP": f"{b}:FSDP", "DP+ZeRO-1": f"{b}:DP;{b}:ZeRO(1)",
                "DP+ZeRO-2": f"{b}:DP;{b}:ZeRO(2)", "Megatron": f"{b}:Megatron"}
    m = model or axes[-1]
    batch = [a for a in axes if a != m]
    fast, slow = [a for a in batch if a not in dcn], [a for a in batch if a in dcn]

    def each(tactic: str, names: list[str]) -> list[str]:
        return [f"{a}:{tactic}" for a in names]

    dp, fsdp, mega, sp = each("DP", batch), each("FSDP", batch), f"{m}:Megatron", f"{m}:SequenceParallel"
    zero1 = each("ZeRO(1)", fast or batch)
    out = {"DP": [*dp, f"{m}:DP"], "FSDP": [*fsdp, f"{m}:FSDP"], "Megatron": [mega],
           "MegatronxDP": [*dp, mega], "MegatronxDP+ZeRO-1": [*dp, mega, *zero1],
           # Megatron first: FSDP's later axis is then minor on the weights' shared dim (a subgroup gather)
           "MegatronxFSDP": [mega, *fsdp]}
    if len(batch) == 1:
        out["HSDP"] = [f"{batch[0]},{m}:HSDP"]
    elif len(batch) == 2 and not slow:  # (with a slow axis: DPxFSDPxMegatron below)
        out["HSDPxMegatron"] = [mega, f"{batch[0]},{batch[1]}:HSDP"]
    if slow and fast:
        out["DPxFSDPxMegatron"] = [mega, *each("DP", slow), *each("FSDP", fast)]
        out["DPxFSDPxMegatronSP"] = [mega, sp, *each("DP", slow), *each("FSDP", fast)]  # torchtitan's 3-D
        out["DPxFSDP"] = [*each("DP", slow), *each("FSDP", [*fast, m])]
    out |= {"DP+ZeRO-2": [*dp, f"{m}:DP", *each("ZeRO(2)", fast or batch)],
            "MegatronSPxDP": [*dp, mega, sp], "MegatronSPxDP+ZeRO-1": [*dp, mega, sp, *zero1],
            "MegatronSPxFSDP": [mega, sp, *fsdp],
            "CPxFSDP": [*fsdp, f"{m}:ContextParallel"], "EPxDP": [*dp, f"{m}:DP", f"{m}:ExpertParallel"],
            "EPxDP+ZeRO-1": [*dp, f"{m}:DP", f"{m}:ExpertParallel", *zero1]}
    return {k: ";".join(v) for k, v in out.items()}


def _row(report: Any) -> dict[str, Any]:
    return {"step_time_s": report.step_time_s, "compute_time_s": report.compute_time_s,
            "comm_time_by_axis": dict(report.comm_time_by_axis), "peak_memory_bytes": report.peak_memory_bytes,
            "feasible": report.feasible}


def run(name: str, episodes: int = 200, anytime: tuple[int, ...] = ()) -> dict[str, Any]:
    """One scenario: every expert's cost and the found plan's, on one captured program; with `anytime`, the
    found plan's ratio to the best expert after each of those episode budgets too."""
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.cost.hardware import parse_bytes
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.options import Options
    from partir_torch.search.api import Auto, SearchConfig, plan_program
    from partir_torch.tactics import apply_schedule
    from partir_torch.workload import load

    model_name, over, hw_name, mesh_text, dcn = ALL[name]
    hw, (mesh, marked) = hardware(hw_name), parse_mesh(mesh_text)
    dcn_axes, limit = frozenset(dcn) | marked, parse_bytes(MEMORY.get(name))
    model, inputs, loss_fn = load(model_name, over)
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    row: dict[str, Any] = {"model": model_name, "overrides": over, "hardware": hw_name, "mesh": mesh_text,
                           "dcn": sorted(dcn_axes), "memory": MEMORY.get(name), "experts": {}}

    def search(budget: int) -> tuple[Any, float]:
        config = SearchConfig.of(Options(hardware=hw, budget=budget, progress=False, memory=limit), dcn_axes)
        t = time.perf_counter()
        plan, _ = plan_program(program, mesh, [Auto()], config, schedule="*:Auto", fallback=False, cache=False)
        return plan, time.perf_counter() - t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an expert that cannot apply here says so in its row)
        for ename, sched in experts(list(mesh.names), dcn_axes).items():
            try:
                row["experts"][ename] = {"schedule": sched, **_row(evaluate(apply_schedule(program, mesh, sched), hw,
                                                                           dcn_axes=dcn_axes, memory_limit=limit))}
            except Exception as e:  # a schedule this program cannot take: the row says why
                row["experts"][ename] = {"schedule": sched, "error": f"{type(e).__name__}: {e}"}
        plan, found_s = search(episodes)
        curve = {b: search(b) for b in anytime}
    row["found"] = {"step_time_s": plan.cost["step_time_s"], "compute_time_s": plan.cost["compute_time_s"],
                    "comm_time_by_axis": plan.cost["comm_time_by_axis"],
                    "peak_memory_bytes": plan.cost["peak_memory_bytes"], "feasible": plan.cost["feasible"],
                    "search_s": found_s, "episodes": plan.search["episodes"], "actions": plan.decisions}
    fits = {k: v for k, v in row["experts"].items() if v.get("feasible")}
    if fits:
        best = min(fits, key=lambda k: fits[k]["step_time_s"])
        row["best_expert"], row["ratio"] = best, plan.cost["step_time_s"] / fits[best]["step_time_s"]
        row["anytime"] = [{"episodes": b, "search_s": t, "feasible": p.cost["feasible"],
                           "ratio": p.cost["step_time_s"] / fits[best]["step_time_s"]} for b, (p, t) in curve.items()]
    return row
