"""Propagation and lowering speed on the GPT-2-small training step (issue [rules] targets).

    .venv/bin/python benchmarks/propagate.py [--repeat 20] [--model gpt2-small]

Both on the full program (every layer walked) and on the folded one the search uses (two of the 12 blocks,
costed as 12; `capture(..., fold=True)`).

Measures (median over repeats, this machine): rule table construction (once per program), a fresh
ShardingState, one group tile action propagated + lowered, and a 3-action plan (batch parallel on the
tokens, column-parallel MLP and attention inputs on `model`) propagated + lowered. Prints a table and
writes benchmarks/results/propagate.json. Targets: one action + lowering <= 5 ms, 3-action plan <= 20 ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (benchmarks.workloads, run as a script)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "propagate.json"))
    args = ap.parse_args()

    from partir_torch import models
    from partir_torch.capture import capture
    from partir_torch.ir import Mesh, Tile
    from partir_torch.lower import lower
    from partir_torch.propagate import ShardingState, program_rules

    model, inputs, loss_fn = models.build(args.model, device="meta")
    out = {}
    for fold in (False, True):
        program = capture(model, inputs, loss_fn, "adamw", fold=fold)
        out["folded" if fold else "full"] = measure(
            program, args, models, Mesh, Tile, lower, ShardingState, program_rules
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from benchmarks.workloads.provenance import stamp

    Path(args.out).write_text(json.dumps({**stamp(), "model": args.model, **out}, indent=1))
    print(f"wrote {args.out}")


def measure(program, args, models, Mesh, Tile, lower, ShardingState, program_rules):
    mesh = Mesh.parse("batch=2,model=4")
    # the program lives for the whole search: move it out of the garbage collector's young generations
    # (as the search loop does), so collections do not rescan its thousands of objects per action
    gc.collect()
    gc.freeze()
    t = time.perf_counter()
    program_rules(program, mesh)
    rules_s = time.perf_counter() - t
    one = Tile("h.*.mlp.c_fc.weight", 0, "model")
    plan = [
        Tile("inputs[0]", 0, "batch"),
        Tile("h.*.mlp.c_fc.weight", 0, "model"),
        Tile("h.*.attn.c_attn.weight", 0, "model"),
    ]

    def timed(fn) -> list[float]:
        out = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    def run(actions):
        st = ShardingState(program, mesh)
        t0 = time.perf_counter()
        for a in actions:
            st.apply(a)
        n = len(lower(st))
        return time.perf_counter() - t0, n

    rows = {
        "state_init": timed(lambda: ShardingState(program, mesh)),
        "one_action": [run([one])[0] for _ in range(args.repeat)],
        "three_actions": [run(plan)[0] for _ in range(args.repeat)],
    }
    res = {"model": args.model, "folded": bool(program.fold), "ops": len(program.ops), "values": len(program.values),
           "rules_once_s": rules_s,
           **{k: {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v)} for k, v in rows.items()},
           "collectives_three_actions": run(plan)[1], "targets_ms": {"one_action": 5, "three_actions": 20}}
    from rich.console import Console
    from rich.table import Table

    kind = "folded" if program.fold else "full"
    tab = Table(title=f"propagation + lowering, {args.model} AdamW step, {kind} ({res['ops']} ops), "
                      "mesh batch=2,model=4")
    for c in ("measure", "median ms", "min ms", "target ms"):
        tab.add_column(c)
    tab.add_row("rule table (once per program)", f"{1e3 * rules_s:.1f}", "", "")
    for k in rows:
        tgt = res["targets_ms"].get(k)
        tab.add_row(k, f"{res[k]['median_ms']:.1f}", f"{res[k]['min_ms']:.1f}", str(tgt or ""))
    Console(width=120).print(tab)
    gc.unfreeze()
    return res


if __name__ == "__main__":
    main()
