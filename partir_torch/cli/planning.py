"""The commands that make and compare plans: `plan` (with the plan cache's request level) and `diff`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from partir_torch.errors import PartirError
from partir_torch.options import from_args

if TYPE_CHECKING:
    from partir_torch.plan import ShardingPlan


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
    return cache.digest({"command": args.command, "model": model, "config": sorted(args.config or []),
                         "mesh": args.mesh, "optimizer": args.optimizer, **from_args(args).planning()})


def _report(plan: ShardingPlan) -> str:
    """What `plan` prints for a plan (without --json), as one text: the request-level cache replays it."""
    lines = [plan.table()]
    from partir_torch.cost.hardware import format_bytes
    from partir_torch.plan.table import episodes

    lines.append("at the memory peak: " + ", ".join(f"{n} ({r}) {format_bytes(b)}"
                                                    for n, r, b in plan.cost["top_at_peak"][:5]))
    if plan.search:
        s = plan.search
        lines.append(f"search: {s['algorithm']}, {episodes(s)}, {s['evaluations']} evaluations in "
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
    if args.cache and not args.explain and not _is_factory(args.model):  # (--explain needs the state)
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
    from partir_torch.capture import capture
    from partir_torch.capture.loop import loop_of
    from partir_torch.errors import CaptureError
    from partir_torch.ir.mesh import check_devices
    from partir_torch.options import Options
    from partir_torch.propagate.analysis import Analysis
    from partir_torch.rules.base import MissingRuleError
    from partir_torch.search import Auto, SearchConfig
    from partir_torch.search.api import InfeasibleError, best_remat, infeasible_message, plan_key, plan_program
    from partir_torch.tactics import parse_schedule, wants_fallback

    opts = from_args(args)
    mesh, dcn = parse_mesh(args.mesh)
    check_devices(mesh, opts.devices)
    # a bad schedule, hardware, memory or budget is reported before the capture
    tactics = parse_schedule(opts.schedule, mesh) if opts.schedule else [Auto(goal=opts.goal)]
    schedule = opts.schedule or ";".join(t.text() for t in tactics)
    config = SearchConfig.of(opts, dcn)
    model, inputs, loss_fn = workload.load(args.model, workload.parse_overrides(args.config))
    fallback = opts.fallback or wants_fallback(opts.schedule)

    def captured(sources: bool, remat: str | None):
        program = capture(model, inputs, loss_fn, args.optimizer, fold=opts.fold,
                          assume_compiling=opts.assume_compiling, fallback=fallback, sources=sources,
                          loop=loop_of(Options.of(opts, remat=remat)))
        Analysis.of(program, mesh, fallback=fallback)  # every op's rule, before the search
        return program

    options = {"fold": opts.fold, "mode": None}

    def plan_with(remat: str | None):
        try:  # without source lines (faster), unless fallback's warnings name them
            prog = captured(sources=fallback, remat=remat)
        except (CaptureError, MissingRuleError):
            if fallback:
                raise
            prog = captured(sources=True, remat=remat)  # the same error, naming the line of the user's code
        return (*plan_program(prog, mesh, tactics, config, schedule=schedule, fallback=fallback, cache=opts.cache,
                              options=options, need_state=args.explain), prog)

    plan, state, program = best_remat(opts, plan_with)
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

        hw = config.hw
        report = evaluate(state, hw, dcn_axes=dcn, memory_limit=config.memory_limit)
        print(explain(state, report, hw, dcn_axes=dcn).table())
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



def cmd_show(args: argparse.Namespace) -> int:
    """Pictures of a saved plan: the whole plan, and each `--tensor`'s blocks per device (`plan/picture.py`)."""
    from pathlib import Path

    from partir_torch.plan import ShardingPlan
    from partir_torch.plan.picture import draw_plan, draw_tensor, tensor_spec

    plan = ShardingPlan.load(args.plan)
    for name in args.tensor or []:
        tensor_spec(plan, name)  # a wrong name is an error before anything is drawn
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(args.plan).stem
    print(draw_plan(plan, out / f"{stem}.png"))
    for name in args.tensor or []:
        safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
        print(draw_tensor(plan, name, out / f"{stem}.{safe}.png"))
    return 0
