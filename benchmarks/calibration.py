"""Calibration of the cost model against XLA's compiled, SPMD-partitioned programs (8-device CPU mesh).

    .venv/bin/python benchmarks/calibration.py [--models tiny-mlp tiny-gpt2 tiny-llama] [--mesh batch=2,model=4]
        [--no-constrain] [--native-layer-norm]

By default XLA gets the plan's constraints on activations and gradients too (what `auto_shard` applies:
module outputs and inputs, parameters' reads, calls inside forwards, the model's output) and runs
LayerNorm as reductions (`backends/xla` says why); the two flags turn those off, to measure what they do.

For every model x plan: collective bytes per device by kind, predicted (in XLA CPU's form: reduce-scatter
counted as the all-reduce it compiles to) vs what XLA emitted, and per-device memory (our liveness peak vs
XLA's buffer-assignment total). Prints a table, writes benchmarks/results/calibration.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.workloads

WIDER_GPT = "tiny-gpt2:width=256,heads=8,seq=128,batch=8,vocab=1024"  # activations outweigh the weights
PLANS = ["batch:BatchParallel", "batch:BatchParallel;model:Megatron",
         "batch:BatchParallel;model:Megatron;batch:ZeRO(1)", "batch:FSDP"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["tiny-mlp", "tiny-gpt2", "tiny-llama", WIDER_GPT],
                    help="zoo names, optionally with overrides: name:key=value,key=value")
    ap.add_argument("--mesh", default="batch=2,model=4")
    ap.add_argument("--no-constrain", action="store_true", help="parameters, inputs and states only")
    ap.add_argument("--native-layer-norm", action="store_true", help="torch_xla's own LayerNorm lowering")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variant = "".join(["-unconstrained" if args.no_constrain else "", "-native-ln" if args.native_layer_norm else ""])
    out = args.out or str(Path(__file__).parent / "results" / f"calibration{variant}.json")
    from rich.console import Console
    from rich.table import Table

    from benchmarks.workloads.calibrate import calibrate

    rows = []
    for spec in args.models:
        m, _, ov = spec.partition(":")
        overrides = dict(kv.split("=", 1) for kv in ov.split(",")) if ov else None
        for plan in PLANS:
            r = calibrate(m, args.mesh, plan, overrides=overrides, constrain=not args.no_constrain,
                          plain_layer_norm=not args.native_layer_norm).to_json()
            r["model"] = spec if len(spec) < 20 else f"{m} ({ov})"
            rows.append(r)
    t = Table(title=f"cost model vs XLA (CPU, {args.mesh}{variant}); bytes per device; predicted / XLA")
    for c in ("model", "plan", "all-reduce", "all-gather", "all-to-all", "coll.-permute", "memory"):
        t.add_column(c)

    def cell(r, k):
        p, x = r["as_cpu"].get(k, 0), r["xla"].get(k, 0)
        return "-" if not p and not x else f"{p} / {x}" + (f" ({p / x:.2f})" if x and p else "")

    for r in rows:
        mem = f"{r['predicted_memory']} / {r['xla_memory']} ({r['memory_ratio']:.2f})" if r["xla_memory"] else "-"
        t.add_row(r["model"], r["schedule"].replace("batch:", "b:").replace("model:", "m:"), cell(r, "all-reduce"),
                  cell(r, "all-gather"), cell(r, "all-to-all"), cell(r, "collective-permute"), mem)
    Console(width=160).print(t)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
