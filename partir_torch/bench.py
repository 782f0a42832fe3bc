"""`partir-torch bench`: the search's plans against the strongest plans a practitioner would write, on the
scenarios of `benchmarks/search.py` (S1-S7), written to `docs/benchmarks.md` with a chart per scenario.

Per scenario the model is captured once (folded), every applicable expert schedule (`experts`: DP, FSDP,
HSDP, ZeRO-1/2, Megatron, Megatron with sequence parallelism, context parallelism, expert parallelism, and
their compositions with DP) is costed with the cost model, and the search runs on the same program with an
episode budget (the same plan on every run); the row reads the found plan's predicted step time against the
best expert that fits. The figures are the cost model's (calibrated against XLA: docs/cost-model.md); the
engines' measured programs are `partir_torch.verify`'s and `benchmarks/engine_torch.py`'s.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
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
QUICK = ("S1", "S2", "S3", "S5", "S6", "S7")  # (the U-Net's captures take most of a full run's time)
SIMPLICITY = 0.005  # the MCTS's and local search's margin (`mcts.MCTS(simplicity=...)`)


def experts(axes: list[str]) -> dict[str, str]:
    """The expert schedules a practitioner would write for these axes (an expert a model cannot take, such as
    expert parallelism without stacked experts, changes nothing and costs what the plan without it does)."""
    if len(axes) == 1:
        (b,) = axes
        return {"DP": f"{b}:DP", "FSDP": f"{b}:FSDP", "DP+ZeRO-1": f"{b}:DP;{b}:ZeRO(1)",
                "DP+ZeRO-2": f"{b}:DP;{b}:ZeRO(2)", "Megatron": f"{b}:Megatron"}
    b, m = axes
    return {"DP": f"{b}:DP;{m}:DP", "FSDP": f"{b}:FSDP;{m}:FSDP", "Megatron": f"{m}:Megatron",
            "MegatronxDP": f"{b}:DP;{m}:Megatron", "MegatronxDP+ZeRO-1": f"{b}:DP;{m}:Megatron;{b}:ZeRO(1)",
            "HSDP": f"{b},{m}:HSDP", "DP+ZeRO-2": f"{b}:DP;{m}:DP;{b}:ZeRO(2)",
            "MegatronSPxDP": f"{b}:DP;{m}:Megatron;{m}:SequenceParallel",
            "MegatronSPxDP+ZeRO-1": f"{b}:DP;{m}:Megatron;{m}:SequenceParallel;{b}:ZeRO(1)",
            "CPxFSDP": f"{b}:FSDP;{m}:ContextParallel", "EPxDP": f"{b}:DP;{m}:DP;{m}:ExpertParallel",
            "EPxDP+ZeRO-1": f"{b}:DP;{m}:DP;{m}:ExpertParallel;{b}:ZeRO(1)"}


def _row(report: Any) -> dict[str, Any]:
    return {"step_time_s": report.step_time_s, "compute_time_s": report.compute_time_s,
            "comm_time_by_axis": dict(report.comm_time_by_axis), "peak_memory_bytes": report.peak_memory_bytes,
            "feasible": report.feasible}


def run(name: str, episodes: int = 200) -> dict[str, Any]:
    """One scenario: every expert's cost and the found plan's, on one captured program."""
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.options import Options
    from partir_torch.search.api import Auto, SearchConfig, plan_program
    from partir_torch.tactics import apply_schedule
    from partir_torch.workload import load

    model_name, over, hw_name, mesh_text, dcn = SCENARIOS[name]
    hw, (mesh, marked) = hardware(hw_name), parse_mesh(mesh_text)
    dcn_axes = frozenset(dcn) | marked
    model, inputs, loss_fn = load(model_name, over)
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    row: dict[str, Any] = {"model": model_name, "overrides": over, "hardware": hw_name, "mesh": mesh_text,
                           "dcn": sorted(dcn_axes), "experts": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an expert that cannot apply here says so in its row)
        for ename, sched in experts(list(mesh.names)).items():
            try:
                row["experts"][ename] = {"schedule": sched, **_row(evaluate(apply_schedule(program, mesh, sched), hw,
                                                                           dcn_axes=dcn_axes))}
            except Exception as e:  # a schedule this program cannot take: the row says why
                row["experts"][ename] = {"schedule": sched, "error": f"{type(e).__name__}: {e}"}
        config = SearchConfig.of(Options(hardware=hw, budget=episodes, progress=False), dcn_axes)
        t = time.perf_counter()
        plan, _ = plan_program(program, mesh, [Auto()], config, schedule="*:Auto", fallback=False, cache=False)
        found_s = time.perf_counter() - t
    row["found"] = {"step_time_s": plan.cost["step_time_s"], "compute_time_s": plan.cost["compute_time_s"],
                    "comm_time_by_axis": plan.cost["comm_time_by_axis"],
                    "peak_memory_bytes": plan.cost["peak_memory_bytes"], "feasible": plan.cost["feasible"],
                    "search_s": found_s, "episodes": plan.search["episodes"], "actions": plan.decisions}
    fits = {k: v for k, v in row["experts"].items() if v.get("feasible")}
    if fits:
        best = min(fits, key=lambda k: fits[k]["step_time_s"])
        row["best_expert"], row["ratio"] = best, plan.cost["step_time_s"] / fits[best]["step_time_s"]
    return row


def chart(name: str, row: dict[str, Any], path: Path) -> Path:
    """The found plan's predicted step time beside each expert's: compute and communication per axis stacked,
    peak memory above each bar, an expert that does not fit hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {"found": row["found"], **{k: v for k, v in row["experts"].items() if "error" not in v}}
    axes = sorted({a for v in bars.values() for a in v["comm_time_by_axis"]})
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(bars), 3.6), dpi=100)
    cmap = plt.get_cmap("Set2")
    for i, (k, v) in enumerate(bars.items()):
        bottom, hatch = 0.0, None if v["feasible"] else "//"
        for j, (part, s) in enumerate([("compute", v["compute_time_s"]),
                                       *((f"comm {a}", v["comm_time_by_axis"].get(a, 0.0)) for a in axes)]):
            ax.bar(i, s * 1e3, bottom=bottom, color=cmap(j), hatch=hatch, edgecolor="black" if k == "found" else
                   "0.4", label=part if i == 0 else None)
            bottom += s * 1e3
        ax.text(i, bottom, f"{v['peak_memory_bytes'] / 2**30:.1f}G", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(bars)), list(bars), rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("predicted step (ms)", fontsize=8)
    ratio = f"{row['ratio']:.3f} x the best expert ({row['best_expert']})" if "ratio" in row else "no expert fits"
    ax.set_title(f"{name}: {row['model']} on {row['mesh']}, {row['hardware']}: found = {ratio}", fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write(rows: dict[str, dict[str, Any]], out: Path, episodes: int) -> Path:
    """`out/benchmarks.md` and `out/bench-<scenario>.png`."""
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmarks: the search against the experts", "",
             "Written by `partir-torch bench` (`partir_torch/bench.py` says how); predicted by the cost model, the "
             f"search on {episodes} episodes (deterministic). Hatched bars: the plan does not fit in memory. The "
             f"search keeps an action only when it buys more than {SIMPLICITY:.1%} of the step time (a decision must "
             "earn its place: `search/local.py`), so a ratio up to that margin above 1 is a simpler plan, not a "
             "worse search.", "",
             "| scenario | model, mesh, hardware | found (ms) | best expert that fits (ms) | ratio | search (s) "
             "| command |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        f = row["found"]
        best = (f"{row['best_expert']} {row['experts'][row['best_expert']]['step_time_s'] * 1e3:.2f}"
                if "best_expert" in row else "none fits")
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "—"
        if "ratio" in row and 1.0 < row["ratio"] <= 1.0 + SIMPLICITY:
            ratio += " (within the simplicity margin)"
        lines.append(f"| {name} | {row['model']}, {row['mesh']}, {row['hardware']} | {f['step_time_s'] * 1e3:.2f}"
                     f"{'' if f['feasible'] else ' (does not fit)'} | {best} | {ratio} | {f['search_s']:.1f} | "
                     f"`partir-torch bench --only {name} --episodes {episodes}` |")
    for name, row in rows.items():
        png = chart(name, row, out / f"bench-{name}.png")
        lines += ["", f"## {name}", "", f"![{name}]({png.name})", "",
                  f"Found: `{'; '.join(row['found']['actions'])}`.", "",
                  "| expert | schedule | step (ms) | peak memory (GiB) | fits |", "|---|---|---|---|---|"]
        for k, v in row["experts"].items():
            if "error" in v:
                lines.append(f"| {k} | `{v['schedule']}` | — | — | {v['error'][:80]} |")
            else:
                lines.append(f"| {k} | `{v['schedule']}` | {v['step_time_s'] * 1e3:.2f} | "
                             f"{v['peak_memory_bytes'] / 2**30:.2f} | {'yes' if v['feasible'] else 'no'} |")
    path = out / "benchmarks.md"
    path.write_text("\n".join(lines) + "\n")
    return path
