"""Same plans before and after a change of the core: the searched plan of S1-S7 and of the renamed GPT, and the
expert schedules' costs, on an episode budget (deterministic), as JSON; `--compare A B` prints the table.

    .venv/bin/python benchmarks/same_plans.py --out before.json [--episodes 60] [--only S1,S7]
    .venv/bin/python benchmarks/same_plans.py --compare before.json after.json

Run it at two commits (`git worktree add`); a row differs when the step time or the actions do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.workloads, this checkout

from benchmarks.search import SCENARIOS

EXPERTS = {"2d": ["{a}:BatchParallel;{b}:Megatron", "{a}:FSDP", "{a}:BatchParallel;{b}:Megatron;{a}:ZeRO(1)",
                  "{a}:BatchParallel;{a}:ZeRO(2)"],
           "1d": ["{a}:BatchParallel", "{a}:FSDP", "{a}:BatchParallel;{a}:ZeRO(1)"]}


def run(names: list[str], episodes: int) -> dict:
    from partir_torch import workload
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.search.api import search
    from partir_torch.tactics import apply_schedule

    out = {}
    for name in names:
        model_name, over, hw_name, mesh_text, dcn, kind = SCENARIOS[name]
        hw = hardware(hw_name)
        mesh, _ = parse_mesh(mesh_text)
        axes = [a for a, _ in mesh.axes]
        cases = [(name, False)] + ([(f"{name}-renamed", True)] if name == "S2" else [])
        for key, rename in cases:
            model, inputs, loss_fn = workload.load(model_name, over, device="meta")
            if rename:
                try:
                    from benchmarks.workloads.renamed import renamed
                except ImportError:  # a tree from before the workloads left the package
                    from partir_torch.models.renamed import renamed

                model = renamed(model)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = search(model, inputs, mesh_text, loss_fn=loss_fn, optimizer="adamw", hardware=hw,
                              dcn_axes=dcn, budget=episodes, cache=False, require_fit=False, progress=False)
            row = {"step_time_s": plan.cost["step_time_s"], "peak_memory_bytes": plan.cost["peak_memory_bytes"],
                   "actions": list(plan.decisions), "time_s": time.perf_counter() - t0, "experts": {}}
            if not rename:
                program = capture(model, inputs, loss_fn, "adamw")
                for text in EXPERTS[kind]:
                    sched = text.format(a=axes[0], b=axes[-1])
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        state = apply_schedule(program, mesh, sched)
                    rep = evaluate(state, hw, dcn_axes=frozenset(dcn))
                    row["experts"][sched] = {"step_time_s": rep.step_time_s, "peak_memory_bytes": rep.peak_memory_bytes}
            out[key] = row
            print(f"{key}: {row['step_time_s'] * 1e3:.3f} ms, {len(row['actions'])} actions, {row['time_s']:.1f} s",
                  flush=True)
    return out


def compare(a: dict, b: dict) -> str:
    lines = ["| scenario | step before (ms) | step after (ms) | same actions | experts: after / before |",
             "|---|---|---|---|---|"]
    for key in a:
        x, y = a[key], b.get(key)
        if y is None:
            lines.append(f"| {key} | {x['step_time_s'] * 1e3:.4f} | (missing) | | |")
            continue
        ex = ", ".join(f"{s}: {y['experts'][s]['step_time_s'] / v['step_time_s']:.4f}"
                       for s, v in x["experts"].items() if s in y["experts"])
        lines.append(f"| {key} | {x['step_time_s'] * 1e3:.4f} | {y['step_time_s'] * 1e3:.4f} | "
                     f"{'yes' if x['actions'] == y['actions'] else 'NO'} | {ex} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--only", default="")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(a, b))
        return
    res = run([s for s in args.only.split(",") if s] or list(SCENARIOS), args.episodes)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
