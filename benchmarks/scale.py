"""Frontier scale (issue [scale]): large models on 64 to 8192 devices, 2-D to 4-D meshes, the whole CLI process.

    .venv/bin/python benchmarks/scale.py [--only L70,L8] [--seeds 3] [--times 5,10,20,30,60] [--skip-anytime]
                                         [--skip-depth] [--skip-cli]

Three parts, each written to benchmarks/results/scale.json and plotted in benchmarks/results/scale.png:
- `cli`: per scenario, the `partir-torch plan` command in a fresh process at its target budget (whole-process
  wall time and peak RSS, from `/usr/bin/time`-like `resource` accounting of the child), its plan's step time
  against the best expert composite, each costed by the same model on the same folded program;
- `anytime`: per large scenario, the ratio to the best expert after each budget in `--times` seconds of search
  (median and range of `--seeds` seeds; the program is captured once per scenario, each search gets a fresh
  analysis so no budget profits from an earlier one's caches);
- `depth`: the GPT family at 12, 24, 48 and 96 layers (GPT-2 small's width, batch 16 x seq 128, same mesh,
  same budget in episodes), each part of the plan command timed in a fresh process (imports, model build,
  capture, search, evaluation, plan expansion, table, JSON).
The experts are `partir-torch bench`'s full set on a mesh `{b1, ..., bk, model}` (the last axis the
model-parallel one; `partir_torch/bench/scenarios.py`): DP, FSDP, Megatron with DP / FSDP / ZeRO-1 / sequence
parallelism, DP on the slow (DCN) axes with FSDP on the fast ones (with and without Megatron), ZeRO-2,
context and expert parallelism; the best that fits is the bar.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# name: (model, overrides, hardware, mesh (":dcn" marks slow axes), CLI budget, wall target s, description)
# L405: the as-trained shape fits no expert composite in 95 GiB (seq 8192, one sequence per batch-parallel
# group, 126 layers of saved activations), not even with full activation checkpointing (`benchmarks/remat.py`,
# where the search with it does fit), so its memory limit is lifted (`MEMORY`) and it is a planning-time and
# step-time scenario only
SCENARIOS = {
    "L70": ("llama2-70b", {}, "tpu-v5p", "data=16:dcn,fsdp=16,model=8", "4s", 10.0,
            "Llama-2-70B, tpu-v5p x 2048 {data:16 DCN, fsdp:16, model:8}"),
    "L70-8k": ("llama2-70b", {"batch": "1024"}, "tpu-v5p", "pod=4:dcn,data=16:dcn,fsdp=16,model=8", "15s", 20.0,
               "Llama-2-70B, tpu-v5p x 8192 {pod:4 DCN, data:16 DCN, fsdp:16, model:8}"),
    "L8": ("llama3-8b", {}, "h100-sxm", "data=8:dcn,model=8", "0.5s", 5.0,
           "Llama-3-8B, h100-sxm x 64 {data:8 IB, model:8}"),
    "L405": ("llama3-405b", {}, "tpu-v5p", "pod=4:dcn,data=8:dcn,fsdp=16,model=16", "17s", None,
             "Llama-3-405B, tpu-v5p x 8192 {pod:4 DCN, data:8 DCN, fsdp:16, model:16}, memory not limited"),
    "G2-h100": ("gpt2-small", {"batch": "16", "seq": "128"}, "h100-sxm", "batch=2,model=4", "0.5s", 3.0,
                "GPT-2 small b16 x s128, h100-sxm x 8 {batch:2, model:4}"),
    "G2-v5e": ("gpt2-small", {"batch": "16", "seq": "128"}, "tpu-v5e", "batch=2,model=4", "0.5s", 3.0,
               "GPT-2 small b16 x s128, tpu-v5e x 8 {batch:2, model:4}"),
}
ANYTIME = ("L70", "L70-8k", "L8", "L405")
MEMORY = {"L405": "4TiB"}
DEPTHS = (12, 24, 48, 96)
DEPTH_EPISODES = "300"


def _limit(name: str) -> float | None:
    from partir_torch.cost.hardware import parse_bytes

    return parse_bytes(MEMORY[name]) if name in MEMORY else None


def best_expert(program, mesh, hw, dcn: frozenset[str], limit: float | None = None) -> dict:
    import warnings

    from partir_torch.bench.scenarios import experts
    from partir_torch.cost import evaluate
    from partir_torch.tactics import apply_schedule

    rows = {}
    for name, sched in experts(list(mesh.names), dcn).items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (expert parallelism on a dense model changes nothing: said there)
            state = apply_schedule(program, mesh, sched)
        r = evaluate(state, hw, dcn_axes=dcn, memory_limit=limit)
        rows[name] = {"schedule": sched, "step_time_s": r.step_time_s, "peak_memory_bytes": r.peak_memory_bytes,
                      "feasible": r.feasible}
    feas = {k: v for k, v in rows.items() if v["feasible"]}
    best = min(feas, key=lambda k: feas[k]["step_time_s"]) if feas else None
    return {"experts": rows, "best": best, "best_s": feas[best]["step_time_s"] if best else None}


def _load(name: str):
    from partir_torch.capture import capture
    from partir_torch.cli import parse_mesh
    from partir_torch.cost import hardware
    from partir_torch.workload import load

    model_name, over, hw_name, mesh_text, *_ = SCENARIOS[name]
    mesh, dcn = parse_mesh(mesh_text)
    model, inputs, loss_fn = load(model_name, over)
    t = time.perf_counter()
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    return program, mesh, dcn, hardware(hw_name), time.perf_counter() - t


def run_cli(name: str, budget: str | None = None, seed: int = 0) -> dict:
    """`partir-torch plan` of scenario `name` in a fresh process: wall time, peak RSS (this child alone: one
    child per call of a fresh helper process), the plan's cost."""
    model_name, over, hw_name, mesh_text, cli_budget, *_ = SCENARIOS[name]
    argv = [sys.executable, "-m", "partir_torch.cli", "plan", model_name, "--mesh", mesh_text, "--hardware", hw_name,
            "--budget", budget or cli_budget, "--seed", str(seed), "--json", "--no-cache"]
    for k, v in over.items():
        argv += ["--config", f"{k}={v}"]
    if name in MEMORY:
        argv += ["--memory", MEMORY[name]]
    # a wrapper process so that RUSAGE_CHILDREN holds this one command's peak RSS
    wrap = ("import resource, subprocess, sys, time, json; t = time.perf_counter(); "
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); w = time.perf_counter() - t; "
            "print(json.dumps({'wall_s': w, 'rc': p.returncode, 'rss': resource.getrusage("
            "resource.RUSAGE_CHILDREN).ru_maxrss * 1024, 'out': p.stdout, 'err': p.stderr[-2000:]}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, "-c", wrap, *argv], capture_output=True, text=True, env=env, check=True)
    res = json.loads(got.stdout)
    if res["rc"] != 0:
        raise RuntimeError(f"{name}: plan failed: {res['err']}")
    plan = json.loads(res["out"])
    return {"wall_s": res["wall_s"], "peak_rss_bytes": res["rss"], "step_time_s": plan["cost"]["step_time_s"],
            "feasible": plan["cost"]["feasible"], "peak_memory_bytes": plan["cost"]["peak_memory_bytes"],
            "search_s": plan["search"]["time_s"], "episodes": plan["search"]["episodes"],
            "budget": budget or cli_budget}


def anytime(name: str, times: list[float], seeds: int) -> dict:
    """Ratio to the best expert after each budget, per seed; a fresh analysis per search."""
    from partir_torch.cost import evaluate
    from partir_torch.propagate.analysis import Analysis
    from partir_torch.search import Auto, Budget, SearchConfig
    from partir_torch.tactics import apply_schedule

    program, mesh, dcn, hw, cap_s = _load(name)
    ex = best_expert(program, mesh, hw, dcn, _limit(name))
    out = {"capture_s": cap_s, "ops": len(program.ops), **ex, "times": times, "runs": {}}
    for t in times:
        ratios = []
        for seed in range(seeds):
            Analysis.forget(program)
            cfg = SearchConfig(hw, dcn, _limit(name), seed, Budget(seconds=t), "mcts")
            state = apply_schedule(program, mesh, [Auto(None, "time", "both")], search=cfg)
            r = evaluate(state, hw, dcn_axes=dcn, memory_limit=_limit(name))
            ratios.append(r.step_time_s / ex["best_s"] if r.feasible and ex["best_s"] else float("inf"))
            print(f"{name} anytime {t:g}s seed {seed}: {ratios[-1]:.3f}", flush=True)
        out["runs"][str(t)] = {"ratios": ratios, "median": statistics.median(ratios)}
    return out


PHASES = """
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
from partir_torch import workload
from partir_torch.capture import capture
from partir_torch.cli import parse_mesh
from partir_torch.cost import evaluate, hardware
from partir_torch.plan import ShardingPlan
from partir_torch.search import Budget, SearchConfig
from partir_torch.search.api import summarize_log
from partir_torch.tactics import Context, apply_schedule, parse_schedule
t_imp = time.perf_counter()
layers, mesh_text, hw_name, budget = sys.argv[1:]
mesh, dcn = parse_mesh(mesh_text)
hw = hardware(hw_name)
config = SearchConfig(hw, dcn, None, 0, Budget.parse(budget), "mcts")
model, inputs, loss_fn = workload.load("gpt2-small", {"layers": layers, "batch": "16", "seq": "128"})
t_build = time.perf_counter()
program = capture(model, inputs, loss_fn, "adamw", fold=True)
t_cap = time.perf_counter()
context = Context(config)
state = apply_schedule(program, mesh, parse_schedule("*:Auto", mesh), context=context)
t_search = time.perf_counter()
report = evaluate(state, hw, dcn_axes=dcn)
t_eval = time.perf_counter()
plan = ShardingPlan.from_state(state, report, schedule="*:Auto", hardware=hw.name, dcn_axes=dcn,
                               search=summarize_log(context.log))
t_plan = time.perf_counter()
table = plan.table()
t_table = time.perf_counter()
text = json.dumps(plan.to_json())
t_json = time.perf_counter()
print(json.dumps({"torch_import_s": t_torch - t0, "imports_s": t_imp - t_torch, "build_s": t_build - t_imp,
                  "capture_s": t_cap - t_build, "search_s": t_search - t_cap, "evaluate_s": t_eval - t_search,
                  "plan_s": t_plan - t_eval, "table_s": t_table - t_plan, "json_s": t_json - t_table,
                  "total_s": t_json - t0, "ops": len(program.ops), "episodes": plan.search["episodes"],
                  "step_time_s": report.step_time_s}))
"""


def depth(repeat: int) -> dict:
    """Each part of the plan command per GPT depth, fresh processes, the minimum of `repeat` runs per part."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out, runs_of = {}, {n: [] for n in DEPTHS}
    for _ in range(repeat):  # depths interleaved, so that a busy spell of the machine hits them alike
        for n in DEPTHS:
            got = subprocess.run([sys.executable, "-c", PHASES, str(n), "batch=2,model=4", "tpu-v5e",
                                  DEPTH_EPISODES], capture_output=True, text=True, env=env, check=True)
            runs_of[n].append(json.loads(got.stdout.strip().splitlines()[-1]))
    for n in DEPTHS:
        runs = runs_of[n]
        best = {k: min(r[k] for r in runs) for k in runs[0] if k.endswith("_s")}
        out[str(n)] = {**best, "ops": runs[0]["ops"], "episodes": runs[0]["episodes"],
                       "step_time_s": runs[0]["step_time_s"]}
        print(f"depth {n}: " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in best.items()), flush=True)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, row in res.get("anytime", {}).items():
        ts = [float(t) for t in row["runs"]]
        med = [min(row["runs"][t]["median"], 3.0) for t in row["runs"]]
        lo = [min(min(row["runs"][t]["ratios"]), 3.0) for t in row["runs"]]
        hi = [min(max(row["runs"][t]["ratios"]), 3.0) for t in row["runs"]]
        a.plot(ts, med, marker="o", label=f"{name}: {SCENARIOS[name][6]}")
        a.fill_between(ts, lo, hi, alpha=0.2)
    a.axhline(1.0, color="k", lw=0.8, ls="--")
    a.set_ylim(0.4, 1.5)
    a.set_xlabel("search budget (s)")
    a.set_ylabel("step time / best expert composite (median of seeds)")
    a.set_title("anytime quality (band: range of seeds; a plan that does not fit: off the top)")
    a.legend(fontsize=7, loc="upper right")
    d = res.get("depth", {})
    if d:
        layers = [int(n) for n in d]
        parts = ["torch_import_s", "imports_s", "build_s", "capture_s", "search_s", "evaluate_s", "plan_s",
                 "table_s", "json_s"]
        bottom = [0.0] * len(layers)
        for p in parts:
            vals = [d[str(n)][p] for n in layers]
            label = "build (with torch._dynamo's import)" if p == "build_s" else p[:-2]
            b.bar([str(n) for n in layers], vals, bottom=bottom, label=label)
            bottom = [x + y for x, y in zip(bottom, vals)]
        b.set_xlabel("GPT layers (width 768, b16 x s128, {batch:2, model:4}, 300 episodes)")
        b.set_ylabel("wall time (s)")
        b.set_title("time vs depth, by part")
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--times", default="5,10,20,30,60")
    ap.add_argument("--anytime", default=",".join(ANYTIME), help="scenarios of the anytime curves")
    ap.add_argument("--cli-repeat", type=int, default=1)
    ap.add_argument("--depth-repeat", type=int, default=3)
    ap.add_argument("--skip-anytime", action="store_true")
    ap.add_argument("--skip-depth", action="store_true")
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG and the table from the JSON")
    ap.add_argument("--out", default=str(RESULTS / "scale.json"))
    args = ap.parse_args()
    out_path = Path(args.out)
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.plot_only:
        plot(res, out_path.with_suffix(".png"))
        print_table(res)
        return
    names = [s for s in args.only.split(",") if s] or list(SCENARIOS)
    if not args.skip_cli:
        res.setdefault("cli", {})
        for name in names:
            program, mesh, dcn, hw, _ = _load(name)
            ex = best_expert(program, mesh, hw, dcn, _limit(name))
            runs = [run_cli(name) for _ in range(args.cli_repeat)]
            best = min(runs, key=lambda r: r["wall_s"])
            target = SCENARIOS[name][5]
            best["vs_best_expert"] = best["step_time_s"] / ex["best_s"] if best["feasible"] and ex["best_s"] else None
            res["cli"][name] = {"description": SCENARIOS[name][6], "wall_target_s": target, **ex, **best,
                                "walls_s": [r["wall_s"] for r in runs]}
            ratio = f"{best['vs_best_expert']:.3f}" if best["vs_best_expert"] else "infeasible"
            print(f"{name}: {best['wall_s']:.2f} s wall (target {target}), {best['peak_rss_bytes'] / 2**30:.2f} GiB "
                  f"RSS, {best['episodes']} episodes, {ratio} x best expert {ex['best']} "
                  f"{(ex['best_s'] or 0) * 1e3:.1f} ms", flush=True)
            del program
            out_path.write_text(json.dumps(res, indent=1))
    if not args.skip_anytime:
        res.setdefault("anytime", {})
        times = [float(t) for t in args.times.split(",")]
        for name in [s for s in args.anytime.split(",") if s and (not args.only or s in names)]:
            res["anytime"][name] = anytime(name, times, args.seeds)
            out_path.write_text(json.dumps(res, indent=1))
    if not args.skip_depth:
        res["depth"] = depth(args.depth_repeat)
        first, last = res["depth"][str(DEPTHS[0])], res["depth"][str(DEPTHS[-1])]
        res["depth_ratio"] = last["total_s"] / first["total_s"]
        print(f"depth: {DEPTHS[-1]} layers / {DEPTHS[0]} layers = {res['depth_ratio']:.2f} (target <= 1.2)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1))
    plot(res, out_path.with_suffix(".png"))
    print_table(res)


def print_table(res: dict) -> None:
    print(f"\n{'scenario':9} {'wall s':>7} {'target':>6} {'RSS GiB':>7} {'episodes':>8} {'vs expert':>9}  best expert")
    for name, r in res.get("cli", {}).items():
        ratio = f"{r['vs_best_expert']:.3f}" if r.get("vs_best_expert") else "-"
        print(f"{name:9} {r['wall_s']:7.2f} {r['wall_target_s'] or '-':>6} {r['peak_rss_bytes'] / 2**30:7.2f} "
              f"{r['episodes']:8d} {ratio:>9}  {r['best']} {(r['best_s'] or 0) * 1e3:.1f} ms")
    for name, row in res.get("anytime", {}).items():
        print(f"{name:9} anytime: " + ", ".join(f"{float(t):g}s {v['median']:.3f}" for t, v in row["runs"].items()))


if __name__ == "__main__":
    main()
