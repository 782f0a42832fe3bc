"""The argument parser: every subcommand and its flags."""

from __future__ import annotations

import argparse

from partir_torch.cli.planning import cmd_diff, cmd_plan, cmd_show
from partir_torch.cli.program import cmd_capture, cmd_coverage, cmd_models, cmd_simulate
from partir_torch.cli.running import cmd_bench, cmd_calibrate, cmd_train, cmd_verify
from partir_torch.options import add_flags

# capture.optim.CLASSES' names, here so the parser needs no torch import (a cached repeat is sub-second)
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad", "adafactor", "nadam", "radam", "adamax")



def build_parser() -> argparse.ArgumentParser:
    """Every subcommand; the planning options are `Options`' fields (`options.add_flags`), each stored under
    the field's name, so that `options.from_args` reads them back as Python's `find_plan` would take them."""
    p = argparse.ArgumentParser(prog="partir-torch", description="Automatic SPMD partitioning for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("capture", help="capture a model's training step and summarize the program")
    c.add_argument("model", help="zoo name (e.g. gpt2-small; see `partir-torch models`) or path/to/file.py:factory")
    c.add_argument("--config", action="append", metavar="KEY=VALUE", help="override a model config field")
    c.add_argument("--optimizer", default="adamw", choices=[*OPTIMIZERS, "none"])
    c.add_argument("--inference", action="store_true", help="capture the forward pass only")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--top", type=int, default=15, help="rows of the op table")
    add_flags(c, only=("assume_compiling",))
    c.set_defaults(fn=cmd_capture)

    cv = sub.add_parser("coverage", help="every aten op of the training step and the rule that covers it")
    cv.add_argument("model")
    cv.add_argument("--config", action="append", metavar="KEY=VALUE")
    cv.add_argument("--optimizer", default="adamw", choices=[*OPTIMIZERS, "none"])
    cv.add_argument("--inference", action="store_true", help="the forward pass only")
    cv.add_argument("--json", action="store_true")
    add_flags(cv, only=("fold", "fallback", "assume_compiling"))
    cv.set_defaults(fn=cmd_coverage)

    sm = sub.add_parser("simulate",
                        help="run a plan per device in plain torch and compare with unsharded (use tiny-* models)")
    sm.add_argument("model")
    sm.add_argument("--config", action="append", metavar="KEY=VALUE")
    sm.add_argument("--mesh", help="e.g. batch=2,model=4 (with --plan: the plan's mesh)")
    sm.add_argument("--plan", metavar="FILE", help="simulate a saved plan (plan --out FILE) instead of a schedule")
    sm.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    sm.add_argument("--json", action="store_true")
    add_flags(sm, only=("schedule", "budget", "seed", "fallback", "assume_compiling"))
    sm.set_defaults(fn=cmd_simulate)

    pl = sub.add_parser("plan", help="search a sharding plan (or evaluate a manual schedule) and print it")
    pl.add_argument("model")
    pl.add_argument("--config", action="append", metavar="KEY=VALUE")
    pl.add_argument("--mesh", required=True, help="e.g. batch=2,model=4; mark a cross-node axis batch=4:dcn")
    pl.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    pl.add_argument("--out", help="write the plan JSON here")
    pl.add_argument("--json", action="store_true", help="print the plan JSON")
    pl.add_argument("--explain", action="store_true",
                    help="also attribute the communication to its causes and show the memory peak's largest values "
                         "(plans even when the plan cache holds the plan)")
    add_flags(pl)
    pl.set_defaults(fn=cmd_plan)

    df = sub.add_parser("diff", help="compare two saved plans (plan --out): cost side by side, changed specs")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--json", action="store_true")
    df.set_defaults(fn=cmd_diff)

    sh = sub.add_parser("show", help="pictures of a saved plan (PNG): the whole plan, and which device holds which "
                                     "block of a tensor")
    sh.add_argument("plan", help="a plan saved with `plan --out` or plan.save()")
    sh.add_argument("--tensor", action="append", metavar="NAME",
                    help="a parameter, input (inputs[0]) or optimizer state (opt.exp_avg[NAME]) to draw; repeatable")
    sh.add_argument("--out", default=".", help="the directory of the PNGs (default: here)")
    sh.set_defaults(fn=cmd_show)

    tr = sub.add_parser("train", help="auto-shard a model, train a few steps on its example batch, and verify the "
                                      "step against the plan (torch backend: --nproc ranks; or torch_xla)")
    tr.add_argument("model")
    tr.add_argument("--config", action="append", metavar="KEY=VALUE")
    tr.add_argument("--mesh", required=True, help="e.g. batch=2,model=4")
    tr.add_argument("--plan", help="apply this saved plan instead of searching")
    tr.add_argument("--out", help="save the plan here")
    tr.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--steps", type=int, default=5)
    tr.add_argument("--backend", choices=("torch", "xla"), default="torch",
                    help="torch: one rank a device on torch.distributed (gloo on the CPU, NCCL on GPUs); xla: "
                         "torch_xla SPMD in this process (the XLA environment)")
    tr.add_argument("--nproc", type=int, default=None,
                    help="torch backend: ranks to start here (default: the mesh's device count); under torchrun "
                         "its ranks are used")
    tr.add_argument("--verify", action="store_true",
                    help="compare the step's collectives and memory with the plan's prediction")
    tr.add_argument("--numerics", action="store_true", help="with --verify: also compare with unsharded")
    add_flags(tr)
    tr.set_defaults(fn=cmd_train)

    cb = sub.add_parser("calibrate", help="measure the collectives (per mesh axis and kind) and compute of --nproc "
                                          "ranks here, as the torch backend prices plans by default; cached")
    cb.add_argument("--mesh", required=True, help="e.g. batch=2,model=2 (each axis's group is measured)")
    cb.add_argument("--nproc", type=int, default=None, help="ranks to start (default: the mesh's devices)")
    cb.add_argument("--fresh", action="store_true", help="measure again, replacing the cached figures")
    cb.add_argument("--json", action="store_true")
    cb.set_defaults(fn=cmd_calibrate)

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

    bn = sub.add_parser("bench", help="the search against the strongest expert plans: the scenarios S1-S7 and the "
                                      "large ones (cost model, with the anytime curve) and the zoo through both "
                                      "engines (measured), written to docs/benchmarks.md with charts")
    bn.add_argument("--quick", action="store_true", help="the scenarios without the U-Net and the large ones but "
                    "L8, two anytime budgets, the engines on two models on {batch: 8} (under 10 minutes)")
    bn.add_argument("--only", help="comma-separated scenarios, e.g. S1,L70 (no engine part unless --engines-from)")
    bn.add_argument("--episodes", type=int, default=200, help="the search's budget (default: 200, as plan's)")
    bn.add_argument("--anytime", help="comma-separated episode budgets of the anytime curve (default: 25,50,100,"
                    "200,400; --quick: 50,200; none with --only)")
    bn.add_argument("--engines-from", metavar="JSON", help="the engine part from an earlier "
                    "`benchmarks/engine.py` run instead of running it (the full run takes about an hour here)")
    bn.add_argument("--no-engines", action="store_true", help="skip the engine part")
    bn.add_argument("--scenarios-from", metavar="JSON", help="the scenario rows of an earlier run's --json")
    bn.add_argument("--json", metavar="PATH", help="also write the scenario rows as JSON")
    bn.add_argument("--out", default="docs", help="where benchmarks.md and the charts go (default: docs)")
    bn.set_defaults(fn=cmd_bench)

    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(fn=cmd_models)
    return p

