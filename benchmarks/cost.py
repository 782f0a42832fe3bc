"""Cost-model speed: full and incremental `evaluate` on training steps (issue [cost] targets).

    .venv/bin/python benchmarks/cost.py [--repeat 20] [--models gpt2-small,gpt2-small:fold,gpt2-xl:fold,unet]

Every program is propagated with `batch:DP;model:Megatron;batch:ZeRO(1)` on the mesh batch=2,model=4 and
costed on tpu-v5e (`:fold` captures with `fold=True`). Measures (median over repeats, this machine):
    first        the program's first evaluation (builds its tables: rules are already there), once
    full cold    a fresh state (the schedule applied again), its cache empty and the results memoized for
                 the program forgotten (`Analysis.clear_memos`): everything computed
    full         a fresh state, its cache empty (the program's memo kept: what other states computed)
    incremental  the search's step: copy the evaluated state, apply one candidate action, evaluate it
                 (`copy+action+eval`, and `eval` alone), over the candidate actions in a fixed random
                 order, cycled until `--repeat` evaluations (the first visit of an action computes the
                 new results, later ones find them memoized)
Prints a table and writes benchmarks/results/cost.json. Targets (gpt2-small, 2261 ops): full <= 20 ms,
incremental <= 2 ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (benchmarks.workloads, run as a script)

SCHEDULE = "batch:DP;model:Megatron;batch:ZeRO(1)"
KINDS = frozenset({"input", "param", "optimizer"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-small,gpt2-small:fold,gpt2-xl:fold,unet")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cost.json"))
    args = ap.parse_args()

    from partir_torch.capture import capture
    from partir_torch.cost import hardware
    from partir_torch.cost.model import evaluate
    from partir_torch.ir import Mesh
    from partir_torch.search.space import apply_action, candidates
    from partir_torch.tactics import apply_schedule
    from partir_torch.workload import load

    mesh, hw = Mesh.parse("batch=2,model=4"), hardware("tpu-v5e")
    res: dict = {"schedule": SCHEDULE, "mesh": str(mesh), "hardware": hw.name, "repeat": args.repeat,
                 "targets_ms": {"gpt2-small": {"full": 20, "incremental_eval": 2}}, "models": {}}
    for spec in args.models.split(","):
        name, _, opt = spec.partition(":")
        model, inputs, loss_fn = load(name)
        program = capture(model, inputs, loss_fn, "adamw", fold=opt == "fold")
        del model
        # the program lives for the whole search: out of the collector's young generations (as the search does)
        gc.collect()
        gc.freeze()

        base = apply_schedule(program, mesh, SCHEDULE)
        t = time.perf_counter()
        evaluate(base, hw)
        first = time.perf_counter() - t

        def full(program, cold: bool) -> list[float]:
            out = []
            for _ in range(args.repeat):
                st = apply_schedule(program, mesh, SCHEDULE)
                if cold:
                    st.analysis.clear_memos()
                t = time.perf_counter()
                evaluate(st, hw)
                out.append(time.perf_counter() - t)
            return out

        cold, warm = full(program, True), full(program, False)
        evaluate(base, hw)
        acts = candidates(base, ("batch", "model"), KINDS)
        random.Random(0).shuffle(acts)
        step, ev = [], []
        i = 0
        while len(ev) < args.repeat and i < 4 * len(acts):
            a = acts[i % len(acts)]
            i += 1
            t = time.perf_counter()
            s = base.copy()
            if not apply_action(s, a):
                continue
            t1 = time.perf_counter()
            evaluate(s, hw)
            t2 = time.perf_counter()
            step.append(t2 - t)
            ev.append(t2 - t1)
        gc.unfreeze()

        def stat(xs):
            if not xs:
                return None
            return {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs)}

        res["models"][spec] = {"ops": len(program.ops), "values": len(program.values), "first_ms": 1e3 * first,
                               "full_cold": stat(cold), "full": stat(warm), "incremental_step": stat(step),
                               "incremental_eval": stat(ev), "actions": len(acts), "incremental_n": len(ev)}

    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"cost evaluation, {SCHEDULE} on {mesh}, {hw.name} (median ms over {args.repeat})")
    for c in ("program", "ops", "first", "full cold", "full", "copy+action+eval", "eval (incremental)"):
        tab.add_column(c)

    def ms(r, k):
        return f"{r[k]['median_ms']:.2f}" if r[k] else "-"

    for spec, r in res["models"].items():
        tab.add_row(spec, str(r["ops"]), f"{r['first_ms']:.1f}", ms(r, "full_cold"), ms(r, "full"),
                    ms(r, "incremental_step"), ms(r, "incremental_eval"))
    Console(width=120).print(tab)
    print("targets (gpt2-small): full <= 20 ms, incremental eval <= 2 ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from benchmarks.workloads.provenance import stamp

    Path(args.out).write_text(json.dumps({**stamp(), **res}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
