"""Users' models on the torch backend: every third-party architecture of the sweep trained on gloo ranks.

    .venv/bin/python benchmarks/torch_users.py [--names hf-gpt2 tv-resnet18 ...] [--steps 3]

Each architecture of `benchmarks/workloads/thirdparty.py` (tiny configs, their default dropout) in float64 on
4 ranks, `{batch: 2, model: 2}` under DP + Megatron + ZeRO-1: `steps` SGD steps (lr 1e-2, momentum 0.9:
linear in the gradient, so a gradient that is zero up to rounding stays negligible, where Adam would scale
it to a full step in the direction of the rounding; `tests/backends/test_distributed.py` runs AdamW) through
`partir_torch.step` beside the unsharded eager model from the same weights and seed. A row: the largest loss
difference (relative), the largest parameter difference (relative to the parameter's scale), the collective
bytes the ranks ran against `lower`'s prediction (by kind and mesh axis) and the rank's peak memory against the
cost model's. Writes benchmarks/results/torch_users.json and the table of docs/distributed.md (between its
markers).
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


def case(rank: int, world: int, name: str, steps: int, fp64: bool = True) -> dict:
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = partir_torch.auto_shard(model, inputs, MESH, loss_fn=loss_fn, optimizer=opt, schedule=SCHEDULE,
                                             backend="torch", cache=False)
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
    return {"loss": max(losses), "params": params,
            "bytes_exact": all(r["measured"] == r["predicted"] for r in rows),
            "measured_bytes": sum(r["measured"] for r in rows), "predicted_bytes": sum(r["predicted"] for r in rows),
            "memory": cmp["measured_peak"] / cmp["predicted_peak"]}


def table(results: dict) -> str:
    lines = ["| architecture | loss diff | parameter diff (first / last step) | collective bytes (measured / "
             "predicted) | memory (measured / predicted) |", "|---|---:|---:|---|---:|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | |")
            continue
        b = f"{r['measured_bytes']:,} / {r['predicted_bytes']:,}" + ("" if r["bytes_exact"] else " (differ)")
        name = name if "float32" not in r else f"{name} (float32; {r['float32']})"
        lines.append(f"| {name} | {r['loss']:.1e} | {r['params'][0]:.1e} / {r['params'][-1]:.1e} | {b} | "
                     f"{r['memory']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    from benchmarks.workloads.thirdparty import NAMES
    from partir_torch.launch import Workers

    ap = argparse.ArgumentParser()
    ap.add_argument("--names", nargs="*")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    out = ROOT / "benchmarks" / "results" / "torch_users.json"
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
                    r = {**w.run(case, name, args.steps, fp64)[0], **(r or {})}
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
    commit = __import__("subprocess").run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=ROOT).stdout.strip()
    out.write_text(json.dumps({"commit": commit, "mesh": MESH, "schedule": SCHEDULE, "steps": args.steps,
                               "rows": results}, indent=1) + "\n")
    text = DOC.read_text()
    body = (f"Measured at commit `{commit}` ({len(results)} architectures; `benchmarks/torch_users.py`):\n\n"
            + table(results))
    DOC.write_text(re.sub(r"(<!-- BEGIN torch_users -->\n).*?(<!-- END torch_users -->)",
                          lambda m: m.group(1) + body + "\n" + m.group(2), text, flags=re.S))


if __name__ == "__main__":
    main()
