"""The `partir-torch` command line. Subcommands mirror the pipeline; each takes MODEL the same way."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from partir_torch.errors import PartirError

# capture.optim.CLASSES' names, here so the parser needs no torch import (a cached repeat is sub-second)
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad", "adafactor", "nadam", "radam", "adamax")

if TYPE_CHECKING:
    from partir_torch.plan import ShardingPlan


def _fmt_bytes(n: float) -> str:
    from partir_torch.cost.hardware import format_bytes

    return format_bytes(n)


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

    con = Console()
    con.print(
        f"[bold]{s['model']}[/]: {s['mode']} step, optimizer {s['optimizer']}, captured in "
        f"{s['capture_time_s']:.2f} s — {s['ops']} ops "
        f"({', '.join(f'{k} {v}' for k, v in s['ops_by_phase'].items())}), "
        f"{s['values']} values"
    )
    con.print(f"parameters: {_fmt_count(s['params'])} in {s['param_tensors']} tensors, {_fmt_bytes(s['param_bytes'])}")
    t = Table(title="values by role")
    for c in ("role", "count", "bytes"):
        t.add_column(c, justify="right" if c != "role" else "left")
    for role, n in s["values_by_role"].items():
        t.add_row(role, str(n), _fmt_bytes(s["bytes_by_role"][role]))
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
                      mode="inference" if args.inference else "train", fold=not args.no_fold,
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
    from partir_torch.ir import Mesh
    from partir_torch.lower import summarize
    from partir_torch.plan import ShardingPlan, specs
    from partir_torch.search import Budget, SearchConfig
    from partir_torch.simulate import FP64_TOLERANCE, TOLERANCE, simulate, simulate_fp64
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
    groups = {"loss": [], "gradients": [], "parameters": [], "optimizer_state": [], "buffers": []}
    for name, d in res.diffs.items():
        key = ("loss" if name == "loss" else "gradients" if name.startswith("grad[") else
               "optimizer_state" if name.startswith("updated.opt.") else
               "parameters" if name.removeprefix("updated[").removesuffix("]") in program.params else "buffers")
        groups[key].append(d)
    by_kind = {k: max(v) for k, v in groups.items() if v}
    fp64 = None  # where fp32 rounding exceeds the tolerance: the same plan on the step captured in fp64
    exact = res.max_rel_diff <= TOLERANCE and res.replica_mismatch <= TOLERANCE
    if not exact:
        fp64 = simulate_fp64(state, model, inputs, loss_fn, args.optimizer, states, seed=args.seed,
                             assume_compiling=args.assume_compiling, fallback=args.fallback)
        exact = fp64 is not None and fp64 <= FP64_TOLERANCE
    out = {
        "model": args.model, "mesh": dict(mesh.axes), "schedule": args.schedule, "exact": exact,
        "max_rel_diff": res.max_rel_diff, "fp64_rel_diff": fp64, "tolerance": TOLERANCE,
        "max_abs_diff": res.max_abs_diff, "max_abs_diff_by_kind": by_kind, "replica_mismatch": res.replica_mismatch,
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
            t.add_row(kind, axis, str(counts[(kind, axis)]), _fmt_bytes(b))
    con.print(t)
    sharded = {n: spec for n, spec in out["params"].items() if any(spec)}
    con.print(f"{len(sharded)} of {len(out['params'])} parameters sharded; {len(state.conflicts)} propagation "
              "conflicts")
    for n, spec in list(sharded.items())[:12]:
        con.print(f"  {n}: {spec}")
    return 0


def _parse_bytes(text: str) -> float:
    from partir_torch.cost.hardware import parse_bytes

    return parse_bytes(text)


def parse_mesh(text: str):
    """`batch=4:dcn,model=8`: an axis marked `:dcn` crosses slices / nodes (DCN, InfiniBand)."""
    from partir_torch.ir.mesh import parse_mesh as parse

    return parse(text)


def _is_factory(model: str) -> bool:
    """MODEL is `file.py:factory` (user code), not a zoo name."""
    return ":" in model and model.rsplit(":", 1)[0].endswith(".py")


def _workload_record(args: argparse.Namespace) -> dict[str, Any]:
    """What the plan was made for, as `verify` reloads it from any directory."""
    model = args.model
    if _is_factory(model):
        path, fn = model.rsplit(":", 1)
        model = f"{os.path.abspath(path)}:{fn}"
    return {"model": model, "config": list(args.config or [])}


def _request_key(args: argparse.Namespace) -> str:
    """The request-level key of the plan cache (`partir_torch/cache.py`): the command line as typed, with a
    factory file's path made absolute; everything that decides the plan, nothing that only formats it."""
    from partir_torch import cache

    model = _workload_record(args)["model"]
    parts = {k: getattr(args, k) for k in ("mesh", "hardware", "memory", "schedule", "seed", "budget", "algorithm",
                                            "no_fold", "fallback", "optimizer", "assume_compiling", "devices")}
    return cache.digest({"command": args.command, "model": model, "config": sorted(args.config or []), **parts})


def _report(plan: ShardingPlan) -> str:
    """What `plan` prints for a plan (without --json), as one text: the request-level cache replays it."""
    lines = [plan.table()]
    lines.append("at the memory peak: " + ", ".join(f"{n} ({r}) {b / 2**20:.1f} MiB"
                                                    for n, r, b in plan.cost["top_at_peak"][:5]))
    if plan.search:
        s = plan.search
        lines.append(f"search: {s['algorithm']}, {s['episodes']} episodes, {s['evaluations']} evaluations in "
                     f"{s['time_s']:.1f} s ({s['evaluations_per_s']:.0f}/s; propagation "
                     f"{s['propagation_time_s']:.1f} s, cost {s['cost_time_s']:.1f} s)")
        for e in s["per_axis"]:
            if e.get("chosen", True):
                mode = f", {e['mode']} search" if "mode" in e else ""
                lines.append(f"  {','.join(e['axes'])} ({e['goal']}{mode}): " + ("; ".join(e["actions"]) or "nothing"))
    return "\n".join(lines)


def _emit_plan(plan: dict[str, Any], text: str, args: argparse.Namespace) -> None:
    if args.out:
        saved = {k: v for k, v in plan.items() if k != "cache"}
        with open(args.out, "w") as f:
            json.dump(saved, f, indent=1)
    if args.json:
        json.dump(plan, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(text)


def cmd_plan(args: argparse.Namespace) -> int:
    request = None
    # the request level serves zoo models only: a factory may read environment variables or files the request
    # key cannot see, so its repeat is captured and served by program (never another program's plan)
    if not args.no_cache and not args.explain and not _is_factory(args.model):  # (--explain needs the state)
        from partir_torch import cache

        request = _request_key(args)
        hit = cache.lookup_request(request)
        if hit is not None:  # the cached repeat: no torch, no capture, no search
            where = cache.path("requests", request)
            note = (f"plan from the cache (request key {request}, {where}; program key {hit['plan_key']}); "
                    "--no-cache plans again")
            _emit_plan({**hit["plan"], "cache": {"level": "request", "key": request, "file": str(where)}},
                       f"{hit['text']}\n{note}", args)
            if hit.get("error"):
                raise PartirError(hit["error"])
            return 0
    return _plan_and_store(args, request)


def _plan_and_store(args: argparse.Namespace, request: str | None) -> int:
    from partir_torch import workload
    from partir_torch.analysis import Analysis
    from partir_torch.capture import capture
    from partir_torch.cost import hardware
    from partir_torch.errors import CaptureError
    from partir_torch.ir.mesh import check_devices
    from partir_torch.rules.base import MissingRuleError
    from partir_torch.search import Budget, SearchConfig
    from partir_torch.search.api import InfeasibleError, infeasible_message, plan_key, plan_program
    from partir_torch.tactics import parse_schedule, wants_fallback

    mesh, dcn = parse_mesh(args.mesh)
    check_devices(mesh, args.devices)
    hw = hardware(args.hardware)
    tactics = parse_schedule(args.schedule, mesh)  # a bad schedule is reported before the capture
    limit = _parse_bytes(args.memory) if args.memory else None
    config = SearchConfig(hw, dcn, limit, args.seed, Budget.parse(args.budget), args.algorithm,
                          progress=None)
    model, inputs, loss_fn = workload.load(args.model, workload.parse_overrides(args.config))
    fallback = args.fallback or wants_fallback(args.schedule)

    def captured(sources: bool):
        program = capture(model, inputs, loss_fn, args.optimizer, fold=not args.no_fold,
                          assume_compiling=args.assume_compiling, fallback=fallback, sources=sources)
        Analysis.of(program, mesh, fallback=fallback)  # every op's rule, before the search
        return program

    try:  # without source lines (faster), unless fallback's warnings name them
        program = captured(sources=fallback)
    except (CaptureError, MissingRuleError):
        if fallback:
            raise
        program = captured(sources=True)  # the same error, naming the line of the user's code
    options = {"fold": not args.no_fold, "mode": None}
    plan, state = plan_program(program, mesh, tactics, config, schedule=args.schedule, fallback=fallback,
                               cache=not args.no_cache, options=options, need_state=args.explain)
    plan.workload = _workload_record(args)
    text = _report(plan)
    error = infeasible_message(plan, mesh) if plan.search and not plan.cost["feasible"] else None
    if request is not None:
        from partir_torch import cache

        stored = {k: v for k, v in plan.to_json().items() if k != "cache"}
        key = plan_key(program, mesh, tactics, config, fallback=fallback, options=options)
        cache.store_request(request, {"plan": stored, "text": text, "plan_key": key, "error": error})
    _emit_plan(plan.to_json(), text, args)
    if args.explain and not args.json:
        from partir_torch.cost import evaluate
        from partir_torch.explain import explain

        print(explain(state, evaluate(state, hw, dcn_axes=dcn, memory_limit=limit), hw, dcn_axes=dcn).table())
    if error:
        raise InfeasibleError(error)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from partir_torch.explain import diff
    from partir_torch.plan import ShardingPlan

    plans = []
    for path in (args.a, args.b):
        try:
            with open(path) as f:
                plans.append(ShardingPlan.from_json(f.read()))
        except (OSError, ValueError, KeyError) as e:
            raise PartirError(f"cannot read a plan from {path}: {e!r}; write one with `partir-torch plan ... --out "
                              f"{path}`") from e
    d = diff(*plans)
    if args.json:
        json.dump(d.to_json(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(str(d))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from partir_torch import workload
    from partir_torch.backends.verify import verify_workload
    from partir_torch.plan import ShardingPlan

    if len(args.targets) > 2:
        raise PartirError(f"verify takes [MODEL] PLAN, got {len(args.targets)} arguments: {args.targets}")
    plan = ShardingPlan.load(args.targets[-1])
    name, config = (args.targets[0] if len(args.targets) == 2 else None), args.config
    if name is None and plan.workload is None:
        raise PartirError(f"{args.targets[-1]} does not record its model (it was saved from Python, not by "
                          "`partir-torch plan`); name it: partir-torch verify MODEL PLAN [--config KEY=VALUE]")
    if name is None:
        name, config = plan.workload["model"], config or plan.workload.get("config")
    overrides = workload.parse_overrides(config)
    model, inputs, _ = workload.load(name, overrides)
    plan.check(model, inputs)  # names, shapes and divisibility before a worker is started
    report = verify_workload(plan, name, overrides, steps=args.steps, numerics=args.numerics)
    if args.json:
        json.dump(report.to_json(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(report.table())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import time

    import torch

    import partir_torch
    from partir_torch import workload
    from partir_torch.ir.mesh import check_devices

    mesh, _ = parse_mesh(args.mesh)
    check_devices(mesh, args.devices)
    partir_torch.start_runtime(args.mesh)  # before any backward of this process (see api.start_runtime)
    torch.manual_seed(args.seed)
    overrides = workload.parse_overrides(args.config)
    model, inputs, loss_fn = workload.load(args.model, overrides, device="cpu")
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {params / 1e6:.2f}M parameters, step inputs {[list(x.shape) for x in inputs]}, "
          f"mesh {mesh}" + (f", memory limit {args.memory}" if args.memory else ""))
    from partir_torch.capture.optim import CLASSES

    cls = CLASSES[args.optimizer]
    optimizer = cls(model.parameters(), lr=args.lr, **({"momentum": 0.9} if args.optimizer == "sgd" else {}))
    t0 = time.perf_counter()
    model, opt = partir_torch.auto_shard(model, inputs, args.mesh, loss_fn=loss_fn, optimizer=optimizer,
                                         schedule=args.schedule, hardware=args.hardware, memory=args.memory,
                                         budget=args.budget, seed=args.seed, plan=args.plan,
                                         progress=None, cache=not args.no_cache, fallback=args.fallback)
    plan = model.partir_plan
    print(plan.table())
    if plan.search:
        print(f"search: {plan.search['episodes']} episodes in {plan.search['time_s']:.1f} s; auto_shard took "
              f"{time.perf_counter() - t0:.1f} s in all")
    if args.out:
        plan.save(args.out)
        print(f"plan saved to {args.out}")
    from partir_torch.backends.xla import train_step

    for step in range(args.steps):
        t = time.perf_counter()
        loss = train_step(model, opt, loss_fn, inputs)
        print(f"step {step}: loss {float(loss.detach()):.4f} ({time.perf_counter() - t:.2f} s"
              + (", compiling" if step == 0 else "") + ")")
    if args.verify:
        report = partir_torch.verify(model, inputs, numerics=args.numerics, steps=max(1, min(args.steps, 3)))
        print(report.table())
    return 0

_FALLBACK_HELP = ("run ops without a tile-mapping rule replicated (one warning per op with its module and the "
                  "communication it adds) instead of stopping, and capture a submodule with data-dependent shapes "
                  "(MoE routing) as one such op; `partir-torch coverage` lists them")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="partir-torch", description="Automatic SPMD partitioning for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("capture", help="capture a model's training step and summarize the program")
    c.add_argument("model", help="zoo name (e.g. gpt2-small; see `partir-torch models`) or path/to/file.py:factory")
    c.add_argument("--config", action="append", metavar="KEY=VALUE", help="override a model config field")
    c.add_argument("--optimizer", default="adamw", choices=[*OPTIMIZERS, "none"])
    c.add_argument("--inference", action="store_true", help="capture the forward pass only")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--top", type=int, default=15, help="rows of the op table")
    c.set_defaults(fn=cmd_capture)

    cv = sub.add_parser("coverage", help="every aten op of the training step and the rule that covers it")
    cv.add_argument("model")
    cv.add_argument("--config", action="append", metavar="KEY=VALUE")
    cv.add_argument("--optimizer", default="adamw", choices=[*OPTIMIZERS, "none"])
    cv.add_argument("--inference", action="store_true", help="the forward pass only")
    cv.add_argument("--no-fold", action="store_true", help="capture every repeated layer (as plan --no-fold)")
    cv.add_argument("--fallback", action="store_true",
                    help="capture a submodule with data-dependent shapes as one op (as plan --fallback) and list it")
    cv.add_argument("--json", action="store_true")
    cv.set_defaults(fn=cmd_coverage)

    sm = sub.add_parser("simulate",
                        help="run a plan per device in plain torch and compare with unsharded (use tiny-* models)")
    sm.add_argument("model")
    sm.add_argument("--config", action="append", metavar="KEY=VALUE")
    sm.add_argument("--mesh", help="e.g. batch=2,model=4 (with --plan: the plan's mesh)")
    sm.add_argument("--schedule", help='e.g. "batch:BatchParallel;model:Megatron;batch:ZeRO(1)"')
    sm.add_argument("--plan", metavar="FILE", help="simulate a saved plan (plan --out FILE) instead of a schedule")
    sm.add_argument("--budget", help="search budget of the schedule's Auto tactics: seconds (30s) or episodes (500); "
                                     "default: a fixed number of episodes")
    sm.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--fallback", action="store_true", help=_FALLBACK_HELP)
    sm.add_argument("--json", action="store_true")
    sm.set_defaults(fn=cmd_simulate)

    pl = sub.add_parser("plan", help="search a sharding plan (or evaluate a manual schedule) and print it")
    pl.add_argument("model")
    pl.add_argument("--config", action="append", metavar="KEY=VALUE")
    pl.add_argument("--mesh", required=True, help="e.g. batch=2,model=4; mark a cross-node axis batch=4:dcn")
    pl.add_argument("--hardware", default="cpu-virtual")
    pl.add_argument("--memory", help="per-device memory limit overriding the preset, e.g. 16GiB")
    pl.add_argument("--schedule", default="*:Auto",
                    help='tactics per axis, e.g. "batch:BatchParallel;model:Auto" (default: search every axis); '
                         'Auto(goal) with goal time|communication|zero')
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--budget", help="search budget: seconds (30s, 2m) or episodes (500); default: 200 episodes, "
                                     "as in Python (the same plan on every run)")
    pl.add_argument("--algorithm", default="mcts", choices=["mcts", "random", "greedy", "beam", "exhaustive"])
    pl.add_argument("--no-fold", action="store_true", help="capture every repeated layer (slower; same costs)")
    pl.add_argument("--fallback", action="store_true", help=_FALLBACK_HELP)
    pl.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    pl.add_argument("--out", help="write the plan JSON here")
    pl.add_argument("--json", action="store_true", help="print the plan JSON")
    pl.add_argument("--explain", action="store_true",
                    help="also attribute the communication to its causes and show the memory peak's largest values "
                         "(plans even when the plan cache holds the plan)")
    pl.set_defaults(fn=cmd_plan)

    df = sub.add_parser("diff", help="compare two saved plans (plan --out): cost side by side, changed specs")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--json", action="store_true")
    df.set_defaults(fn=cmd_diff)

    tr = sub.add_parser("train", help="auto-shard a model with torch_xla in this process, train a few steps on its "
                                      "example batch, and verify the compiled step against the plan")
    tr.add_argument("model")
    tr.add_argument("--config", action="append", metavar="KEY=VALUE")
    tr.add_argument("--mesh", required=True, help="e.g. batch=2,model=4")
    tr.add_argument("--hardware", default=None, help="cost model preset (default cpu-virtual)")
    tr.add_argument("--memory", help="per-device memory limit, e.g. 64MiB")
    tr.add_argument("--schedule", default=None, help="default: search every axis")
    tr.add_argument("--budget", help="as plan's (default: 200 episodes)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--plan", help="apply this saved plan instead of searching")
    tr.add_argument("--out", help="save the plan here")
    tr.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    tr.add_argument("--fallback", action="store_true", help=_FALLBACK_HELP)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--steps", type=int, default=5)
    tr.add_argument("--verify", action="store_true", help="compile the step with the HLO dump and compare")
    tr.add_argument("--numerics", action="store_true", help="with --verify: also compare with unsharded")
    tr.set_defaults(fn=cmd_train)

    vf = sub.add_parser("verify", help="compile a saved plan's step with torch_xla and compare XLA's collectives "
                                       "and memory with the prediction")
    vf.add_argument("targets", nargs="+", metavar="[MODEL] PLAN",
                    help="a plan saved with `plan --out` (it records its MODEL and --config) or plan.save() (name "
                         "the MODEL before it)")
    vf.add_argument("--config", action="append", metavar="KEY=VALUE")
    vf.add_argument("--steps", type=int, default=1, help="training steps to run")
    vf.add_argument("--numerics", action="store_true", help="also run unsharded and report max |difference|")
    vf.add_argument("--json", action="store_true")
    vf.set_defaults(fn=cmd_verify)

    for sp in (pl, tr):
        sp.add_argument("--no-cache", action="store_true",
                        help="bypass the plan cache ($XDG_CACHE_HOME/partir_torch): search, and store nothing")
        sp.add_argument("--devices", type=int, help="the device count the mesh must span (checked before capture)")
    for sp in (c, cv, sm, pl):
        sp.add_argument("--assume-compiling", action="store_true",
                        help="capture with torch.compiler.is_compiling() true, so libraries skip data-dependent "
                             "checks they skip under torch.compile (HF transformers' SDPA attention-mask check)")

    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(fn=cmd_models)
    return p


def cmd_models(args: argparse.Namespace) -> int:
    from partir_torch import models

    for name in models.names():
        print(f"{name:14s} {models.config(name)}")
    return 0


# commands that start no runtime or worker: as a program (`main()` without arguments) they end the process
# without its teardown, which frees the search's millions of objects one by one (over a second for a 70B plan)
_FAST_EXIT = frozenset({"plan", "capture", "coverage", "models", "diff"})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.fn(args)
    except PartirError as e:
        print(f"partir-torch: error: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:  # outside a search (a search returns its best plan so far)
        print("partir-torch: interrupted", file=sys.stderr)
        return 130
    if argv is None and args.command in _FAST_EXIT:
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
