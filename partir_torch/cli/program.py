"""The commands that read a program: `capture`, `coverage`, `simulate`, `models`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from partir_torch.errors import PartirError


def _fmt_count(n: int) -> str:
    for unit, k in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= k:
            return f"{n / k:.2f}{unit}"
    return str(n)


def cmd_capture(args: argparse.Namespace) -> int:
    from partir_torch import workload
    from partir_torch.capture import capture

    model, inputs, loss_fn = workload.load(args.model, workload.parse_overrides(args.config))
    optimizer = None if args.optimizer == "none" else args.optimizer
    program = capture(model, inputs, loss_fn, optimizer, mode="inference" if args.inference else "train",
                      assume_compiling=args.assume_compiling)
    summary = program.summary()
    summary["model"] = args.model
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
        return 0
    _print_capture(summary, args.top)
    return 0


def _print_capture(s: dict[str, Any], top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from partir_torch.cost.hardware import format_bytes

    con = Console()
    con.print(
        f"[bold]{s['model']}[/]: {s['mode']} step, optimizer {s['optimizer']}, captured in "
        f"{s['capture_time_s']:.2f} s — {s['ops']} ops "
        f"({', '.join(f'{k} {v}' for k, v in s['ops_by_phase'].items())}), "
        f"{s['values']} values"
    )
    con.print(f"parameters: {_fmt_count(s['params'])} in {s['param_tensors']} tensors, "
              f"{format_bytes(s['param_bytes'])}")
    t = Table(title="values by role")
    for c in ("role", "count", "bytes"):
        t.add_column(c, justify="right" if c != "role" else "left")
    for role, n in s["values_by_role"].items():
        t.add_row(role, str(n), format_bytes(s["bytes_by_role"][role]))
    con.print(t)
    t = Table(title=f"ops by aten target (top {top} of {len(s['ops_by_target'])})")
    t.add_column("aten op")
    t.add_column("count", justify="right")
    for name, n in list(s["ops_by_target"].items())[:top]:
        t.add_row(name, str(n))
    con.print(t)
    t = Table(title=f"repeated-layer groups ({len(s['groups'])})")
    for c in ("group", "layers", "members"):
        t.add_column(c)
    for key, members in zip(s["group_keys"], s["groups"]):
        params = [m for m in members if "[" not in m]
        shown = ", ".join(params[:2]) + (f", … {params[-1]}" if len(params) > 2 else "")
        t.add_row(key, str(len(params)), f"{len(members)} values: {shown}")
    con.print(t)


def cmd_coverage(args: argparse.Namespace) -> int:
    """The decomposition and rule lookup `plan` runs, reported: every op that would fail or fall back."""
    from partir_torch import workload
    from partir_torch.capture import capture
    from partir_torch.rules.decompose import coverage

    model, inputs, loss_fn = workload.load(args.model, workload.parse_overrides(args.config))
    optimizer = None if args.optimizer == "none" else args.optimizer
    program = capture(model, inputs, loss_fn if not args.inference else None, optimizer,
                      mode="inference" if args.inference else "train", fold=args.fold,
                      assume_compiling=args.assume_compiling, fallback=args.fallback)
    cov = coverage(program)
    if args.json:
        json.dump({"model": args.model, **cov.to_json()}, sys.stdout)
        sys.stdout.write("\n")
        return 0 if cov.ok else 1
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    n_ok = sum(r is not None for r in cov.ops.values())
    t = Table(title=f"{args.model}: rule coverage of the step plan runs ({n_ok}/{len(cov.ops)} aten ops)")
    for c in ("aten op", "count", "rule"):
        t.add_column(c, justify="right" if c == "count" else "left")
    for op, r in cov.ops.items():
        t.add_row(op, str(cov.counts[op]), r or "[red]missing[/]")
    con = Console(width=120)
    con.print(t)
    for u in cov.missing:
        con.print(f"[red]no rule after decomposition:[/] {escape(str(u))}")
    for e in cov.errors:
        con.print(f"[red]rule error:[/] {escape(e)}")
    if not cov.ok:
        con.print("plan fails on these; add rules (partir_torch/rules/<family>.py), or pass --fallback to run them "
                  "replicated")
    return 0 if cov.ok else 1


def cmd_simulate(args: argparse.Namespace) -> int:
    import torch

    import partir_torch.search  # noqa: F401  (the search's actions and Auto, read from a plan's decisions)
    from partir_torch import workload
    from partir_torch.capture import capture, optimizer_spec
    from partir_torch.cost.hardware import format_bytes
    from partir_torch.ir import Mesh
    from partir_torch.lower import summarize
    from partir_torch.plan import ShardingPlan, specs
    from partir_torch.search import Budget, SearchConfig
    from partir_torch.simulate import FP64_TOLERANCE, TOLERANCE, rounding, simulate, simulate_fp64
    from partir_torch.tactics import apply_schedule

    Budget.parse(args.budget)  # a bad budget is reported before the capture
    torch.manual_seed(args.seed)
    model, inputs, loss_fn = workload.load(args.model, workload.parse_overrides(args.config), device="cpu")
    if any(p.is_meta for p in model.parameters()):
        raise PartirError(f"{args.model} was built on meta; the simulator needs real weights")
    if (args.plan is None) == (args.schedule is None):
        raise PartirError("simulate needs a plan to run: --schedule TEXT, or --plan FILE (saved by `plan --out`)")
    plan = ShardingPlan.load(args.plan) if args.plan else None
    if plan is None and args.mesh is None:
        raise PartirError("simulate --schedule needs --mesh, e.g. --mesh batch=2,model=2")
    mesh = Mesh.parse(args.mesh) if args.mesh else Mesh.of(plan.mesh)
    if plan is not None:
        plan.check(model, inputs, dict(mesh.axes))  # every mismatch with the model and mesh, listed
    program = capture(model, inputs, loss_fn, args.optimizer, assume_compiling=args.assume_compiling,
                      fallback=args.fallback)
    if plan is not None:
        state = plan.to_state(program, fallback=args.fallback)
        args.schedule = f"plan {args.plan}"
    else:
        config = SearchConfig(seed=args.seed, budget=Budget.parse(args.budget))  # Auto: bounded, default or given
        state = apply_schedule(program, mesh, args.schedule, fallback=args.fallback, search=config)
    params = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(args.seed)
    # optimizer states in the parameter's dtype (what torch.optim keeps; a bf16 model has bf16 states)
    spec = optimizer_spec(args.optimizer, dict(model.named_parameters()))
    states = {n: spec.example_states(n, p, g) for n, p in params.items() if n in spec.hparams}
    program = state.program  # ops without rules may have been decomposed
    res = simulate(program, state, params, dict(model.named_buffers()), inputs, states)
    groups: dict[str, list[str]] = {"loss": [], "gradients": [], "parameters": [], "optimizer_state": [],
                                    "buffers": []}
    for name in res.diffs:
        key = ("loss" if name == "loss" else "gradients" if name.startswith("grad[") else
               "optimizer_state" if name.startswith("updated.opt.") else
               "parameters" if name.removeprefix("updated[").removesuffix("]") in program.params else "buffers")
        groups[key].append(name)
    groups = {k: v for k, v in groups.items() if v}
    by_kind = {k: max(res.diffs[n] for n in v) for k, v in groups.items()}
    rel_by_kind = {k: max(res.rel_diffs[n] for n in v) for k, v in groups.items()}
    # what rounding alone explains: the least precise dtype the step computes in (a float32 loss of bf16
    # logits rounds as bf16); the float64 re-run decides exactness
    bound = max(rounding(v.dtype) for v in program.values if v.dtype.is_floating_point)
    fp64 = None  # where fp32 rounding exceeds the tolerance: the same plan on the step captured in fp64
    exact = res.max_rel_diff <= TOLERANCE and res.replica_mismatch <= TOLERANCE
    if not exact:
        fp64 = simulate_fp64(state, model, inputs, loss_fn, args.optimizer, states, seed=args.seed,
                             assume_compiling=args.assume_compiling, fallback=args.fallback)
        exact = fp64 is not None and fp64 <= FP64_TOLERANCE
    out = {
        "model": args.model, "mesh": dict(mesh.axes), "schedule": args.schedule, "exact": exact,
        "max_rel_diff": res.max_rel_diff, "fp64_rel_diff": fp64, "tolerance": TOLERANCE,
        "max_abs_diff": res.max_abs_diff, "max_abs_diff_by_kind": by_kind, "rel_diff_by_kind": rel_by_kind,
        "rounding": bound, "replica_mismatch": res.replica_mismatch,
        "conflicts": [c.describe(program) for c in state.conflicts],
        "collectives": [c.to_json(state) for c in res.collectives],
        "comm_bytes": summarize(res.collectives), "executed": res.executed,
        "params": specs(state).params,
    }
    if args.json:
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console(width=120)
    con.print(f"[bold]{args.model}[/] on {mesh} with {args.schedule}: max |sharded - unsharded| = "
              f"{res.max_abs_diff:.3g} (" + ", ".join(f"{k} {v:.2g}" for k, v in by_kind.items()) + "), relative "
              f"{res.max_rel_diff:.2g}" + ("" if fp64 is None else f"; in fp64 {fp64:.2g}") +
              (" [green]exact[/]" if exact else " [red]NOT the unsharded step[/]"))
    t = Table(title="collectives (bytes per device)")
    for c in ("kind", "axis", "count", "bytes"):
        t.add_column(c)
    counts: dict[tuple[str, str], int] = {}
    for c in res.collectives:
        counts[(c.kind, c.axis)] = counts.get((c.kind, c.axis), 0) + 1
    for kind, axes in out["comm_bytes"].items():
        for axis, b in axes.items():
            t.add_row(kind, axis, str(counts[(kind, axis)]), format_bytes(b))
    con.print(t)
    sharded = {n: spec for n, spec in out["params"].items() if any(spec)}
    con.print(f"{len(sharded)} of {len(out['params'])} parameters sharded; {len(state.conflicts)} propagation "
              "conflicts")
    for n, spec in list(sharded.items())[:12]:
        con.print(f"  {n}: {spec}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from partir_torch import models

    for name in models.names():
        print(f"{name:14s} {models.config(name)}")
    return 0

