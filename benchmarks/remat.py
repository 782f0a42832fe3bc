"""Activation checkpointing at scale, in the cost model: torchtitan's layouts with their AC against the search.

    .venv/bin/python benchmarks/remat.py [--only L70,L405] [--episodes 200]

Per large scenario of `partir_torch/bench/scenarios.py` (L70: Llama-2-70B on 2048 tpu-v5p; L405: Llama-3-405B
on 8192), the step is captured (folded) kept, with selective and with full activation checkpointing
(`capture/remat.py`; torchtitan's `activation_checkpoint.mode = "selective" | "full"`). On each capture, every
expert composite (`scenarios.experts`: torchtitan's 3-D PP-less layout is `DPxFSDPxMegatronSP`) is costed, and
the search runs with the CLI's default budget (200 episodes). `remat="auto"` keeps the search's best fitting
plan over the three captures; the row compares it with the best expert that fits under any AC mode. Both are
judged at the hardware's memory (95 GiB a v5p chip) and, for L405, also with the limit lifted (as
`benchmarks/scale.py` runs it). Writes benchmarks/results/remat.json and prints the table of docs/scale.md.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = (None, "selective", "full")


def scenario(name: str, episodes: int, limit_text: str | None) -> dict:
    from partir_torch.bench.scenarios import ALL, experts
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.cost.hardware import parse_bytes
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.ir.program import Loop
    from partir_torch.options import Options
    from partir_torch.search.api import Auto, SearchConfig, plan_program
    from partir_torch.tactics import apply_schedule
    from partir_torch.workload import load

    model_name, over, hw_name, mesh_text, dcn = ALL[name]
    hw, (mesh, marked) = hardware(hw_name), parse_mesh(mesh_text)
    dcn_axes, limit = frozenset(dcn) | marked, parse_bytes(limit_text)
    model, inputs, loss_fn = load(model_name, over)
    row: dict = {"model": model_name, "mesh": mesh_text, "hardware": hw_name, "memory": limit_text or "hardware",
                 "modes": {}}
    for mode in MODES:
        t = time.perf_counter()
        program = capture(model, inputs, loss_fn, "adamw", fold=True, loop=Loop(remat=mode))
        out: dict = {"capture_s": time.perf_counter() - t, "experts": {}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for ename, sched in experts(list(mesh.names), dcn_axes).items():
                try:
                    rep = evaluate(apply_schedule(program, mesh, sched), hw, dcn_axes=dcn_axes, memory_limit=limit)
                except Exception as e:  # (a schedule this model cannot take)
                    out["experts"][ename] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                out["experts"][ename] = {"step_time_s": rep.step_time_s, "peak_memory_bytes": rep.peak_memory_bytes,
                                         "feasible": rep.feasible}
            config = SearchConfig.of(Options(hardware=hw, budget=episodes, progress=False, memory=limit), dcn_axes)
            t = time.perf_counter()
            plan, _ = plan_program(program, mesh, [Auto()], config, schedule="*:Auto", fallback=False, cache=False)
        out["found"] = {"step_time_s": plan.cost["step_time_s"], "peak_memory_bytes": plan.cost["peak_memory_bytes"],
                        "feasible": plan.cost["feasible"], "search_s": time.perf_counter() - t}
        row["modes"][str(mode)] = out
        print(f"{name} remat={mode}: found {plan.cost['step_time_s']:.3f} s "
              f"({plan.cost['peak_memory_bytes'] / 2**30:.1f} GiB, fits {plan.cost['feasible']})", flush=True)
    fits = [(e["step_time_s"], m, k) for m, o in row["modes"].items() for k, e in o["experts"].items()
            if e.get("feasible")]
    found = [(o["found"]["step_time_s"], m) for m, o in row["modes"].items() if o["found"]["feasible"]]
    if found:
        row["auto"] = {"step_time_s": min(found)[0], "remat": min(found)[1]}
    if fits:
        row["best_expert"] = {"step_time_s": min(fits)[0], "remat": min(fits)[1], "layout": min(fits)[2]}
    if found and fits:
        row["ratio"] = row["auto"]["step_time_s"] / row["best_expert"]["step_time_s"]
    return row


def table(rows: list[dict]) -> str:
    out = ["| scenario | memory | AC | torchtitan 3-D (DPxFSDPxMegatronSP) | best expert | search | search time |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        for mode, o in r["modes"].items():
            tt = o["experts"].get("DPxFSDPxMegatronSP", {})
            fits = {k: e for k, e in o["experts"].items() if e.get("feasible")}
            best = min(fits, key=lambda k: fits[k]["step_time_s"]) if fits else None

            def cell(e):
                if not e or "step_time_s" not in e:
                    return "n/a"
                return f"{e['step_time_s']:.2f} s, {e['peak_memory_bytes'] / 2**30:.0f} GiB" + (
                    "" if e["feasible"] else " (does not fit)")

            out.append(f"| {r['name']} | {r['memory']} | {mode} | {cell(tt)} | "
                       f"{(best + ': ' + cell(fits[best])) if best else 'none fits'} | {cell(o['found'])} | "
                       f"{o['found']['search_s']:.1f} s |")
        if "ratio" in r:
            out.append(f"| {r['name']} | {r['memory']} | **auto: {r['auto']['remat']}** | | best "
                       f"{r['best_expert']['layout']} ({r['best_expert']['remat']}) | **{r['ratio']:.3f} x** | |")
        elif "auto" in r:
            out.append(f"| {r['name']} | {r['memory']} | **auto: {r['auto']['remat']}** | | none fits | "
                       f"**{r['auto']['step_time_s']:.2f} s, fits** | |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="L70,L405")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--table", action="store_true", help="print the table of the saved results only")
    args = ap.parse_args()
    path = ROOT / "benchmarks" / "results" / "remat.json"
    if args.table:
        print(table(json.loads(path.read_text())["rows"]))
        return
    rows = []
    for name in args.only.split(","):
        for limit in [None, "4TiB"] if name == "L405" else [None]:
            rows.append({"name": name, **scenario(name, args.episodes, limit)})
    path.write_text(json.dumps({"episodes": args.episodes, "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
