"""The commands that run a plan on an engine: `train` and `verify`."""

from __future__ import annotations

import argparse
import json
import sys

from partir_torch.cli.planning import parse_mesh
from partir_torch.errors import PartirError
from partir_torch.options import from_args


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
    """Plan, train and verify on the torch backend (`--nproc` ranks started here, or this torchrun job's) or
    on torch_xla SPMD in this process (`--backend xla`)."""
    from partir_torch.ir.mesh import check_devices

    mesh, _ = parse_mesh(args.mesh)
    check_devices(mesh, from_args(args).devices)
    if args.backend == "xla":
        import partir_torch
        from partir_torch.api import require_xla

        require_xla()
        partir_torch.start_runtime(args.mesh)  # before any backward of this process (see api.start_runtime)
        _train(0, 1, args)
        return 0
    import os

    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized()) or "TORCHELASTIC_RUN_ID" in os.environ:
        _train(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), args)  # torchrun's ranks
        return 0
    nproc = args.nproc or mesh.devices
    if nproc != mesh.devices:
        raise PartirError(f"--nproc {nproc} ranks cannot hold the mesh {mesh} of {mesh.devices} devices: the torch "
                          f"backend runs one rank a device (--nproc {mesh.devices}, or another --mesh)")
    from partir_torch import launch

    print(f"starting {nproc} ranks (torch backend; gloo on the CPU, NCCL on GPUs)", flush=True)
    launch.spawn(_train, nproc, args)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Start `--nproc` ranks and measure them (`backends/distributed/calibrate.py`)."""
    mesh, _ = parse_mesh(args.mesh)
    nproc = args.nproc or mesh.devices
    if nproc != mesh.devices:
        raise PartirError(f"--nproc {nproc} ranks cannot hold the mesh {mesh} of {mesh.devices} devices")
    from partir_torch import launch

    launch.spawn(_calibrate, nproc, args)
    return 0


def _calibrate(rank: int, world: int, args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from partir_torch.backends.distributed import calibrate
    from partir_torch.backends.distributed.runtime import connect
    from partir_torch.backends.distributed.shard import hardware_of
    from partir_torch.cost.hardware import format_bytes

    m, dcn = parse_mesh(args.mesh)
    rm = connect(m, dcn)
    if args.fresh and rank == 0:
        calibrate.cached_path(rm).unlink(missing_ok=True)
    hw = calibrate.measured(rm, base=hardware_of(rm.device)[0])
    if rank != 0:
        return
    if args.json:
        print(json.dumps(asdict(hw)))
        return
    print(f"{hw.name} ({world} ranks, mesh {m}): cached at {calibrate.cached_path(rm)}")
    print(f"  matmul {hw.peak_flops_fp32 / 1e9:.1f} GFLOP/s, elementwise {format_bytes(hw.hbm_bandwidth)}/s, "
          f"an op at least {hw.launch_floor * 1e6:.1f} us")
    for axis, kind, alpha, beta in hw.links:
        print(f"  {kind:<15} over {axis:<8} {alpha * 1e6:9.1f} us a call + {format_bytes(beta)}/s")


def _train(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank's job (the only one on XLA): rank 0 prints."""
    import time

    import torch

    import partir_torch
    from partir_torch import workload
    from partir_torch.capture.optim import CLASSES

    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)  # every rank builds the same model
    model, inputs, loss_fn = workload.load(args.model, workload.parse_overrides(args.config), device="cpu")
    params = sum(p.numel() for p in model.parameters())
    say(f"{args.model}: {params / 1e6:.2f}M parameters, step inputs {[list(x.shape) for x in inputs]}, "
        f"mesh {args.mesh}" + (f", memory limit {args.memory}" if args.memory else "") + f", {args.backend} backend")
    cls = CLASSES[args.optimizer]
    optimizer = cls(model.parameters(), lr=args.lr, **({"momentum": 0.9} if args.optimizer == "sgd" else {}))
    t0 = time.perf_counter()
    model, opt = partir_torch.auto_shard(model, inputs, args.mesh, loss_fn=loss_fn, optimizer=optimizer,
                                         options=from_args(args), plan=args.plan, backend=args.backend)
    plan = model.partir_plan
    say(plan.table())
    if plan.search:
        from partir_torch.plan.table import episodes

        say(f"search: {episodes(plan.search)} in {plan.search['time_s']:.1f} s; auto_shard took "
            f"{time.perf_counter() - t0:.1f} s in all")
    if args.out and rank == 0:
        plan.save(args.out)
        say(f"plan saved to {args.out}")
    for step in range(args.steps):
        t = time.perf_counter()
        loss = partir_torch.step(model, opt, *inputs)
        say(f"step {step}: loss {float(loss.detach()):.4f} ({time.perf_counter() - t:.2f} s"
            + (", compiling" if step == 0 and args.backend == "xla" else "") + ")", flush=True)
    if args.verify:
        steps = max(1, min(args.steps, 3))
        report = (partir_torch.verify(model, inputs, numerics=args.numerics, steps=steps) if args.backend == "xla"
                  else partir_torch.verify(model, inputs, steps=steps if args.numerics else 0))
        say(report.table())


def cmd_bench(args: argparse.Namespace) -> int:
    """The search against the experts (`partir_torch/bench/`): the scenarios with their anytime curve, and the
    zoo through both engines, written to `--out`/benchmarks.md."""
    import json
    from pathlib import Path

    from partir_torch.bench import engines, report, scenarios

    names = [s for s in (args.only or "").split(",") if s] or list(scenarios.QUICK if args.quick
                                                                    else scenarios.ALL)
    unknown = [s for s in names if s not in scenarios.ALL]
    if unknown:
        raise PartirError(f"unknown scenario(s) {unknown}; the scenarios: {', '.join(scenarios.ALL)}")
    if args.anytime is not None:
        try:
            budgets = tuple(int(b) for b in args.anytime.split(",") if b)
        except ValueError:
            raise PartirError(f"--anytime takes episode counts such as 50,200; got {args.anytime!r}") from None
    else:
        budgets = () if args.only else (50, 200) if args.quick else scenarios.ANYTIME
    rows = {}
    if args.scenarios_from:
        rows = {k: v for k, v in json.loads(Path(args.scenarios_from).read_text()).items() if k in names}
    for name in [n for n in names if n not in rows]:
        rows[name] = row = scenarios.run(name, args.episodes, budgets)
        ratio = f"{row['ratio']:.3f} x the best expert ({row['best_expert']})" if "ratio" in row else "no expert fits"
        print(f"{name}: found {row['found']['step_time_s'] * 1e3:.2f} ms = {ratio}, searched in "
              f"{row['found']['search_s']:.1f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    engine_rows, engine_episodes, engine_commit = None, args.episodes, None
    if args.engines_from:
        got = json.loads(Path(args.engines_from).read_text())
        engine_rows, engine_episodes, engine_commit = got["rows"], got["episodes"], got.get("commit")
    elif not (args.no_engines or args.only):
        models, meshes = ((engines.QUICK_MODELS, engines.QUICK_MESHES) if args.quick
                          else (engines.MODELS, engines.MESHES))
        engine_rows = engines.run(models, meshes, args.episodes)
    print(report.write(rows, Path(args.out), args.episodes, engine_rows, engine_episodes, engine_commit))
    return 0
