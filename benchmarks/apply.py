"""Apply benchmark: what `auto_shard` costs beyond the search, and the sharded step on the 8-device CPU mesh.

    .venv/bin/python benchmarks/apply.py [--models gpt2-small tiny-gpt2] [--steps 3]

Per model, in a fresh process (torch_xla's runtime is per process): the plan is searched first (reported
apart), then `auto_shard(..., plan=plan)` is timed from a model with weights on the host (parts: runtime
start, plan check, moves and marks, hooks, optimizer rebuild; `apply_s` is the whole call), then the
first step (trace + compile + run) and the steady step time (median of the next steps). Prints a table and
writes benchmarks/results/apply.json. Target (issue [apply]): apply_s <= 2 s for GPT-2 small.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

MESH = "batch=2,model=4"
CONFIGS = {"gpt2-small": {"batch": "8", "seq": "128"}, "tiny-gpt2": {"batch": "8"}, "llama-7b": {
    "layers": "4", "width": "512", "heads": "8", "kv_heads": "8", "ffn": "1376", "vocab": "8192", "seq": "128",
    "batch": "8"}}


def one(name: str, steps: int) -> dict:
    import torch

    import partir_torch
    from partir_torch import models

    t = time.perf_counter()
    partir_torch.start_runtime(MESH)
    runtime_s = time.perf_counter() - t
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build(name, CONFIGS.get(name), device="cpu")
    t = time.perf_counter()
    plan = partir_torch.find_plan(model, inputs, MESH, loss_fn=loss_fn, optimizer="adamw",
                               schedule="batch:BatchParallel;model:Megatron;batch:ZeRO(1)", cache=False)
    plan_s = time.perf_counter() - t
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = time.perf_counter()
    model, sopt = partir_torch.auto_shard(model, inputs, MESH, backend="xla", loss_fn=loss_fn, optimizer=opt, plan=plan)
    apply_s = time.perf_counter() - t
    from partir_torch.backends.xla import train_step

    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        float(train_step(model, sopt, loss_fn, inputs))
        times.append(time.perf_counter() - t)
    return {"model": name, "config": CONFIGS.get(name), "mesh": MESH, "schedule": plan.schedule,
            "params": sum(p.numel() for p in model.parameters()), "runtime_start_s": runtime_s, "plan_s": plan_s,
            "apply_s": apply_s, "first_step_s": times[0], "step_s": statistics.median(times[1:]), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny-gpt2", "gpt2-small"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps)))
        return
    rows = []
    for name in args.models:
        res = subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(args.steps)],
                             capture_output=True, text=True, timeout=3600)
        if res.returncode:
            print(f"{name}: failed\n{res.stderr[-2000:]}")
            continue
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"{'model':12s} {'params':>9s} {'plan s':>7s} {'apply s':>8s} {'1st step s':>11s} {'step s':>7s}")
    for r in rows:
        print(f"{r['model']:12s} {r['params'] / 1e6:8.1f}M {r['plan_s']:7.2f} {r['apply_s']:8.2f} "
              f"{r['first_step_s']:11.2f} {r['step_s']:7.2f}")
    out = Path(__file__).parent / "results" / "apply.json"
    out.write_text(json.dumps({"machine": platform.machine(), "cpus": __import__("os").cpu_count(), "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
