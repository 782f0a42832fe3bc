"""Users' models on the torch backend: every third-party architecture of the sweep trained on gloo ranks.

    .venv/bin/python benchmarks/torch_users.py [--names hf-gpt2 tv-resnet18 ...] [--steps 3] [--searched 0.6]

Each architecture of `benchmarks/workloads/thirdparty.py` (tiny configs, their default dropout) in float64 on
4 ranks, `{batch: 2, model: 2}` under DP + Megatron + ZeRO-1: `steps` SGD steps (lr 1e-2, momentum 0.9:
linear in the gradient, so a gradient that is zero up to rounding stays negligible, where Adam would scale
it to a full step in the direction of the rounding; `tests/backends/test_distributed.py` runs AdamW) through
`partir_torch.step` beside the unsharded eager model from the same weights and seed. A row: the largest loss
difference (relative), the largest parameter difference (relative to the parameter's scale), the collective
bytes the ranks ran against `lower`'s prediction (by kind and mesh axis) and the rank's peak memory against the
cost model's. Writes benchmarks/results/torch_users.json and the table of docs/distributed.md (between its
markers). `--searched F`: the plan the search finds (200 episodes, cpu-virtual) under F x the replicated step's
predicted peak instead of the expert schedule, so that the model axis is needed: the search's plans on models
it was never tuned on, proven the same way (torch_users_searched.json, the second table).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MESH, SCHEDULE = "batch=2,model=2", "batch:BatchParallel;model:Megatron;batch:ZeRO(1)"
SKIP = {"hf-mixtral": "its MoE routing has data-dependent shapes: captured only with fallback=True (docs/models.md)"}
DOC = ROOT / "docs" / "distributed.md"


def _limit(model, inputs, loss_fn, opt, fraction: float) -> int:
    """`fraction` x the predicted per-device peak of the plan that shards nothing."""
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.tactics import apply_schedule

    program = capture(model, inputs, loss_fn, opt)
    return int(fraction * evaluate(apply_schedule(program, parse_mesh(MESH)[0], []), hardware("cpu-virtual"))
               .peak_memory_bytes)


def case(rank: int, world: int, name: str, steps: int, fp64: bool = True, searched: float | None = None) -> dict:
    """One architecture on this rank: the figures of a row (rank 0's are kept)."""
    import torch

    import partir_torch
    from benchmarks.workloads import thirdparty
    from partir_torch.backends.distributed import engine, measure

    model, inputs, loss_fn = thirdparty.build(name)
    if fp64:
        model = model.double()
        inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref))
    how = {"schedule": SCHEDULE} if searched is None else {
        "memory": _limit(model, inputs, loss_fn, opt, searched), "hardware": "cpu-virtual"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = partir_torch.auto_shard(model, inputs, MESH, loss_fn=loss_fn, optimizer=opt, backend="torch",
                                             cache=False, **how)
    rec = engine.sharded(model)
    cmp = measure.compare(rec, measure.run_once(rec, model, opt, inputs))
    losses, params = [], []
    for _ in range(steps):
        rng = torch.get_rng_state()
        got = float(partir_torch.step(model, opt, *inputs))
        torch.set_rng_state(rng)  # the unsharded step draws the same dropout masks
        loss = loss_fn(ref, *inputs)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(abs(got - loss.item()) / max(1.0, abs(loss.item())))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        params.append(max(((full[n] - p).abs().max() / p.abs().max().clamp(min=1)).item()
                          for n, p in ref.named_parameters()))
    rows = cmp["by_axis"]
    plan = rec.plan
    used = sorted({a for spec in [*plan.params.values(), *plan.inputs] for d in spec if d
                   for a in (d if isinstance(d, (list, tuple)) else [d])})
    return {"loss": max(losses), "params": params, "axes": used, "unexpected": len(cmp["unexpected"]),
            "sharded": sum(any(spec) for spec in plan.params.values()), "of": len(plan.params),
            "bytes_exact": all(r["measured"] == r["predicted"] for r in rows),
            "measured_bytes": sum(r["measured"] for r in rows), "predicted_bytes": sum(r["predicted"] for r in rows),
            "memory": cmp["measured_peak"] / cmp["predicted_peak"]}


def table(results: dict, searched: bool = False) -> str:
    plan = " | parameters sharded | axes used" if searched else ""
    lines = ["| architecture | loss diff | parameter diff (first / last step) | collective bytes (measured / "
             f"predicted) | memory (measured / predicted){plan} |", "|---|---:|---:|---|---:|" + "---|---|" * searched]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | |" + " | |" * searched)
            continue
        b = f"{r['measured_bytes']:,} / {r['predicted_bytes']:,}" + ("" if r["bytes_exact"] else " (differ)")
        b += f", {r['unexpected']} unplanned" if r.get("unexpected") else ""
        name = name if "float32" not in r else f"{name} (float32; {r['float32']})"
        extra = f" | {r['sharded']} of {r['of']} | {', '.join(r['axes']) or 'none'}" if searched else ""
        lines.append(f"| {name} | {r['loss']:.1e} | {r['params'][0]:.1e} / {r['params'][-1]:.1e} | {b} | "
                     f"{r['memory']:.2f}{extra} |")
    return "\n".join(lines)


def main() -> None:
    from benchmarks.workloads.thirdparty import NAMES
    from partir_torch.launch import Workers

    ap = argparse.ArgumentParser()
    ap.add_argument("--names", nargs="*")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--searched", type=float, default=None, help="the searched plan under this fraction of the "
                    "replicated step's memory, instead of the expert schedule")
    args = ap.parse_args()
    tag = "torch_users" if args.searched is None else "torch_users_searched"
    out = ROOT / "benchmarks" / "results" / f"{tag}.json"
    results = json.loads(out.read_text())["rows"] if args.names and out.exists() else {}
    w = Workers(4, timeout=900)
    try:
        for name in args.names or NAMES:
            if name in SKIP:
                results[name] = {"error": f"not run: {SKIP[name]}"}
                continue
            t = time.perf_counter()
            r = None
            for fp64 in (True, False):  # (a model whose own code fails in float64 runs in float32, and says so)
                try:
                    r = {**w.run(case, name, args.steps, fp64, args.searched)[0], **(r or {})}
                    break
                except Exception as e:  # the row says what failed; the ranks are started again
                    why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
                    r = {"error": why} if not fp64 else {"float32": f"in float64: {why}"}
                    w.close()
                    w = Workers(4, timeout=900)
            r["s"] = time.perf_counter() - t
            results[name] = r
            print(name, r, flush=True)
    finally:
        w.close()
    from benchmarks.workloads.provenance import stamp

    where = stamp()
    how = {"schedule": SCHEDULE} if args.searched is None else {"searched": args.searched}
    out.write_text(json.dumps({**where, "mesh": MESH, **how, "steps": args.steps, "rows": results},
                              indent=1) + "\n")
    text = DOC.read_text()
    flag = "" if args.searched is None else f" --searched {args.searched}"
    body = (f"Measured at commit `{where['commit']}` on torch {where['torch']} ({len(results)} architectures; "
            f"`benchmarks/torch_users.py{flag}`):\n\n"
            + table(results, args.searched is not None))
    DOC.write_text(re.sub(rf"(<!-- BEGIN {tag} -->\n).*?(<!-- END {tag} -->)",
                          lambda m: m.group(1) + body + "\n" + m.group(2), text, flags=re.S))


if __name__ == "__main__":
    main()
