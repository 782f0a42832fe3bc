"""Search against expert plans and baselines, on the scenarios of issue [search] (S1-S7).

    .venv/bin/python benchmarks/search.py [--budget 20s] [--seeds 5] [--only S1,S7] [--quick]

Per scenario: the model is captured once (folded: two of N identical blocks, costed as all N), every
applicable expert schedule is evaluated with the cost model, then MCTS (incremental, axis by axis, and
joint, and the default "both" that splits the budget between them and keeps the better), random search,
greedy and beam search each get the same time budget. Reported: search time,
episodes, estimated step time and peak memory, feasibility, and the ratio of the found plan's step time to
the best feasible expert plan (target <= 1.01). MCTS is rerun with `--seeds` seeds (spread target <= 2 %).
Prints a table and writes benchmarks/results/search.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

SCENARIOS = {
    # name: (model, overrides, hardware, mesh, dcn axes, experts)
    "S1": ("gpt2-xl", {}, "tpu-v5e", "batch=2,model=4", (), "2d"),
    "S2": ("gpt-6.7b", {}, "h100-sxm", "batch=4,model=8", ("batch",), "2d"),
    "S3": ("llama-7b", {"batch": "16"}, "tpu-v5p", "data=8,model=8", (), "2d"),
    "S4a": ("unet", {}, "tpu-v4", "batch=8", (), "1d"),
    "S4b": ("unet", {}, "tpu-v4", "batch=4,model=2", (), "2d"),
    "S5": ("gns", {}, "tpu-v4", "batch=2,model=4", (), "2d"),
    "S6": ("moe", {}, "h100-sxm", "batch=2,expert=8", ("batch",), "2d"),
    "S7": ("mlp", {"batch": "65536", "width": "64", "hidden": "256"}, "cpu-virtual", "batch=8", (), "1d"),
}


def experts(axes: list[str]) -> dict[str, str]:
    if len(axes) == 1:
        (b,) = axes
        return {"DP": f"{b}:DP", "FSDP": f"{b}:FSDP", "DP+ZeRO-1": f"{b}:DP;{b}:ZeRO(1)", "Megatron": f"{b}:Megatron"}
    b, m = axes
    return {"DP": f"{b}:DP;{m}:DP", "FSDP": f"{b}:FSDP;{m}:FSDP", "Megatron": f"{m}:Megatron",
            "MegatronxDP": f"{b}:DP;{m}:Megatron", "MegatronxDP+ZeRO-1": f"{b}:DP;{m}:Megatron;{b}:ZeRO(1)"}


def renamed_megatron(model_name, over, mesh, hw, dcn, budget) -> dict:
    """Search the renamed model; count the structural column/row linear pairs the plan tiles Megatron-style
    on the model axis, and whether the inputs are batch-parallel."""
    from partir_torch import capture
    from partir_torch.models.renamed import renamed
    from partir_torch.search import search
    from partir_torch.tactics import apply_schedule, linears, megatron_pairs
    from partir_torch.workload import load

    model, inputs, loss_fn = load(model_name, over)
    model = renamed(model)
    t = time.perf_counter()
    plan = search(model, inputs, mesh, loss_fn=loss_fn, hardware=hw, dcn_axes=dcn, budget=budget, require_fit=False)
    el = time.perf_counter() - t
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    rules = apply_schedule(program, mesh, f"{mesh.names[0]}:DP").rules
    lin, pairs = linears(program, rules), megatron_pairs(program, rules)
    model_axis = mesh.names[-1]
    hit = 0
    for col, row in pairs:
        w1, out1, _ = lin[col]
        w2, _, in2 = lin[row]
        s1, s2 = plan.params[program.values[w1].name], plan.params[program.values[w2].name]
        hit += model_axis in str(s1[out1]) and model_axis in str(s2[in2])
    return {"pairs": len(pairs), "megatron_pairs_found": hit, "inputs": plan.inputs, "time_s": el,
            "step_time_s": plan.cost["step_time_s"], "feasible": plan.cost["feasible"],
            "example_names": [n for n in plan.params][:3]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="20s")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--only", default="")
    ap.add_argument("--quick", action="store_true", help="MCTS only (incremental and joint), one seed")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "search.json"))
    args = ap.parse_args()

    from partir_torch import capture
    from partir_torch.cli import parse_mesh
    from partir_torch.cost import evaluate, hardware
    from partir_torch.search import Auto, Budget, SearchConfig
    from partir_torch.search.api import summarize_log
    from partir_torch.tactics import apply_schedule
    from partir_torch.workload import load

    names = [s for s in args.only.split(",") if s] or list(SCENARIOS)
    results = {}
    for name in names:
        model_name, over, hw_name, mesh_text, dcn, _ = SCENARIOS[name]
        mesh, _ = parse_mesh(mesh_text)
        hw = hardware(hw_name)
        model, inputs, loss_fn = load(model_name, over)
        t0 = time.perf_counter()
        program = capture(model, inputs, loss_fn, "adamw", fold=True)
        cap_s = time.perf_counter() - t0
        gc.collect()
        gc.freeze()
        row = {"model": model_name, "overrides": over, "hardware": hw_name, "mesh": mesh_text, "dcn": list(dcn),
               "capture_s": cap_s, "ops": len(program.ops), "fold": program.fold, "experts": {}, "search": {}}

        def rec(state, extra=None, hw=hw, dcn=dcn):
            r = evaluate(state, hw, dcn_axes=frozenset(dcn))
            out = {"step_time_s": r.step_time_s, "peak_memory_bytes": r.peak_memory_bytes, "feasible": r.feasible,
                   "comm_bytes": {k: sum(v.values()) for k, v in r.comm_bytes.items()}}
            return {**out, **(extra or {})}

        for ename, sched in experts(list(mesh.names)).items():
            try:
                row["experts"][ename] = rec(apply_schedule(program, mesh, sched), {"schedule": sched})
            except Exception as e:  # an expert plan that cannot apply here (e.g. no linear pairs)
                row["experts"][ename] = {"error": str(e), "schedule": sched}
        runs = [("mcts", "both", s) for s in range(1 if args.quick else args.seeds)]  # the default
        if len(mesh.names) > 1:
            runs += [("mcts", "incremental", 0), ("mcts", "joint", 0)]
        if not args.quick:
            runs += [("random", "incremental", 0), ("greedy", "incremental", 0), ("beam", "incremental", 0)]
        for algo, mode, seed in runs:
            cfg = SearchConfig(hw, frozenset(dcn), None, seed, Budget.parse(args.budget), algo)
            t1 = time.perf_counter()
            state = apply_schedule(program, mesh, [Auto(None, "time", mode)], search=cfg)
            el = time.perf_counter() - t1
            st = summarize_log(cfg.log) or {}
            key = f"{algo}-{mode}" + (f"-seed{seed}" if algo == "mcts" and mode == "both" else "")
            row["search"][key] = rec(state, {"time_s": el, "episodes": st.get("episodes"),
                                             "evaluations": st.get("evaluations"),
                                             "actions": [a for e in cfg.log if e.get("chosen", True)
                                                         for a in e["actions"]]})
            print(f"{name} {key}: {row['search'][key]['step_time_s'] * 1e3:.2f} ms, "
                  f"{row['search'][key]['peak_memory_bytes'] / 2**30:.2f} GiB, {el:.1f} s", flush=True)
        if name == "S2":  # the same search on a copy whose every module and parameter name is meaningless
            row["renamed"] = renamed_megatron(model_name, over, mesh, hw, dcn, args.budget)
            print(f"S2 renamed: {row['renamed']}", flush=True)
        feas = [v["step_time_s"] for v in row["experts"].values() if v.get("feasible")]
        row["best_expert_s"] = min(feas) if feas else None
        for v in row["search"].values():
            v["vs_best_expert"] = v["step_time_s"] / row["best_expert_s"] if feas and v["feasible"] else None
        seeds = [v["step_time_s"] for k, v in row["search"].items() if "seed" in k]
        row["seed_spread"] = max(seeds) / min(seeds) - 1 if seeds else None
        results[name] = row
        gc.unfreeze()

    print(f"\n{'scenario':8} {'plan':28} {'step ms':>10} {'peak GiB':>9} {'fits':>5} {'vs expert':>9} {'time s':>7} {'episodes':>8}")
    for name, row in results.items():
        for ename, v in row["experts"].items():
            if "error" in v:
                print(f"{name:8} {'expert ' + ename:28} {'n/a: ' + v['error'][:60]}")
                continue
            print(f"{name:8} {'expert ' + ename:28} {v['step_time_s'] * 1e3:10.2f} {v['peak_memory_bytes'] / 2**30:9.2f} "
                  f"{'yes' if v['feasible'] else 'NO':>5}")
        for k, v in row["search"].items():
            ratio = f"{v['vs_best_expert']:.3f}" if v["vs_best_expert"] else "-"
            print(f"{name:8} {k:28} {v['step_time_s'] * 1e3:10.2f} {v['peak_memory_bytes'] / 2**30:9.2f} "
                  f"{'yes' if v['feasible'] else 'NO':>5} {ratio:>9} {v['time_s']:7.1f} {v['episodes'] or 0:8d}")
        if row["seed_spread"] is not None:
            print(f"{name:8} MCTS seed spread {row['seed_spread'] * 100:.2f} %  (capture {row['capture_s']:.1f} s, {row['ops']} ops)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(Path(args.out).read_text()) if Path(args.out).exists() and args.only else {}
    prev.update(results)
    Path(args.out).write_text(json.dumps({"budget": args.budget, **prev} if not args.only else prev, indent=1))


if __name__ == "__main__":
    main()
