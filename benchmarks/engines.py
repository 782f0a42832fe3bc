"""Where each engine's measured program still differs from the plan: writes docs/engines.md.

    .venv/bin/python benchmarks/engines.py [--models tiny-gpt2 ...] [--mesh batch=2,model=2] [--out docs/engines.md]

Per zoo model (tiny sizes) and plan (an expert schedule and the searched plan, 60 episodes, cpu-virtual) on the
mesh: torch_xla (`partir_torch.backends.verify`: the step compiled in a fresh process with the HLO dump on,
its collectives by kind and mesh axes and its memory read back) and the torch backend on gloo ranks (one
process per device: the rank program's collectives counted as they run, `backends/distributed/measure.py`).
A row is written for every (kind, axes) whose measured bytes differ from the predicted ones, every collective
the plan did not predict, and the memory measured over predicted; the cause column is the documented one
where there is one (`backends/verify.py` `KNOWN_CPU`), else GSPMD's own partitioning (XLA) or "unexplained".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ["tiny-mlp", "tiny-gpt2", "tiny-llama", "tiny-gns", "tiny-moe", "tiny-vit", "tiny-unet"]
PLANS = {"expert": "batch:DP;model:Megatron;batch:ZeRO(1)", "searched": "*:Auto"}
CONFIG = {"tiny-gpt2": {"batch": "8"}, "tiny-llama": {"batch": "8"}}


def _plan(name: str, mesh: str, schedule: str):
    import partir_torch
    from partir_torch import models

    model, inputs, loss_fn = models.build(name, CONFIG.get(name), device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return partir_torch.find_plan(model, inputs, mesh, loss_fn=loss_fn, schedule=schedule, budget=60,
                                      progress=False, require_fit=False)


def xla_rows(names: list[str], mesh: str) -> list[dict]:
    from partir_torch.backends.verify import KNOWN_CPU, verify_workload

    rows = []
    for name in names:
        for which, schedule in PLANS.items():
            t = time.perf_counter()
            try:
                rep = verify_workload(_plan(name, mesh, schedule), name, CONFIG.get(name))
            except Exception as e:  # a plan the engine cannot compile is a row too
                rows.append({"engine": "torch_xla", "model": name, "plan": which, "kind": "error", "axes": "",
                             "predicted": None, "measured": None, "cause": f"{type(e).__name__}: {e}"[:200]})
                continue
            for r in rep.by_axis:
                p, m = r["predicted"], r["measured"]
                if abs(m - p) > 0.01 * max(p, 1):
                    rows.append({"engine": "torch_xla", "model": name, "plan": which, "kind": r["kind"],
                                 "axes": ",".join(r["axes"]) if isinstance(r["axes"], list) else str(r["axes"]),
                                 "predicted": p, "measured": m,
                                 "cause": KNOWN_CPU.get(r["kind"], "GSPMD partitions it another way")})
            rows.append({"engine": "torch_xla", "model": name, "plan": which, "kind": "memory", "axes": "",
                         "predicted": rep.predicted["peak_memory_bytes"], "measured": rep.measured["peak_memory_bytes"],
                         "cause": "XLA's buffer assignment and scheduling"})
            print(f"xla {name} {which}: {time.perf_counter() - t:.0f} s", flush=True)
    return rows


def _torch_rank(rank: int, world: int, names: list[str], mesh: str) -> list[dict]:
    import torch

    import partir_torch
    from partir_torch import models
    from partir_torch.backends.distributed import engine, measure

    rows = []
    for name in names:
        for which, schedule in PLANS.items():
            torch.manual_seed(0)
            model, inputs, loss_fn = models.build(name, CONFIG.get(name), device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, opt = partir_torch.auto_shard(model, inputs, mesh, loss_fn=loss_fn, optimizer=opt,
                                                     backend="torch", schedule=schedule, budget=60, progress=False)
            rec = engine.sharded(model)
            cmp = measure.compare(rec, measure.run_once(rec, model, opt, inputs))
            for r in cmp["by_axis"]:
                if r["predicted"] != r["measured"]:
                    rows.append({"engine": "torch", "model": name, "plan": which, "kind": r["kind"],
                                 "axes": str(r.get("axis", r.get("axes", ""))), "predicted": r["predicted"],
                                 "measured": r["measured"], "cause": "unexplained"})
            rows.append({"engine": "torch", "model": name, "plan": which, "kind": "memory", "axes": "",
                         "predicted": cmp["predicted_peak"], "measured": cmp["measured_peak"],
                         "cause": "the CPU allocator's caching and the eager step's temporaries"})
            partir_torch.unshard(model)
    return rows if rank == 0 else []


def torch_rows(names: list[str], mesh: str) -> list[dict]:
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.launch import Workers

    with Workers(parse_mesh(mesh)[0].devices, timeout=3600) as ranks:
        return [r for out in ranks.run(_torch_rank, names, mesh) if out for r in out]


def write(rows: list[dict], names: list[str], mesh: str, path: Path) -> None:
    def fmt(b):
        return "—" if b is None else f"{b / 1024:.1f} KiB"

    differ = [r for r in rows if r["kind"] != "memory"]
    lines = ["# Engines: where the measured program differs from the plan", "",
             f"Written by `.venv/bin/python benchmarks/engines.py` (its docstring says how) on {mesh}, for "
             f"{', '.join(names)}, each with an expert plan (`{PLANS['expert']}`) and the searched one.", ""]
    for engine in ("torch", "torch_xla"):
        mine = [r for r in differ if r["engine"] == engine]
        plans = len(names) * len(PLANS)
        lines.append(f"- **{engine}**: {len(mine)} collective row(s) differ from the prediction over {plans} plans.")
    lines += ["", "| engine | model | plan | kind | mesh axes | predicted | measured | cause |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['model']} | {r['plan']} | {r['kind']} | {r['axes']} | {fmt(r['predicted'])} | "
              f"{fmt(r['measured'])} | {r['cause']} |" for r in differ]
    lines += ["", "## Memory, measured over predicted (peak per device)", "",
              "| model | plan | torch | torch_xla |", "|---|---|---|---|"]
    for name in names:
        for which in PLANS:
            got = {r["engine"]: r for r in rows if r["kind"] == "memory" and r["model"] == name and r["plan"] == which}
            cells = [f"{got[e]['measured'] / got[e]['predicted']:.2f}" if e in got and got[e]["predicted"] else "—"
                     for e in ("torch", "torch_xla")]
            lines.append(f"| {name} | {which} | {cells[0]} | {cells[1]} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--mesh", default="batch=2,model=2")
    ap.add_argument("--out", default=str(ROOT / "docs" / "engines.md"))
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-xla", action="store_true")
    args = ap.parse_args()
    rows = [] if args.skip_torch else torch_rows(args.models, args.mesh)
    rows += [] if args.skip_xla else xla_rows(args.models, args.mesh)
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "engines.json").write_text(json.dumps(rows, indent=1))
    write(rows, args.models, args.mesh, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
