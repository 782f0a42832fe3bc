"""The argument parser: every subcommand and its flags."""

from __future__ import annotations

import argparse

from partir_torch.cli.planning import cmd_diff, cmd_plan
from partir_torch.cli.program import cmd_capture, cmd_coverage, cmd_models, cmd_simulate
from partir_torch.cli.running import cmd_train, cmd_verify

# capture.optim.CLASSES' names, here so the parser needs no torch import (a cached repeat is sub-second)
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad", "adafactor", "nadam", "radam", "adamax")


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

