"""The `partir-torch` command line. Subcommands mirror the pipeline; each takes MODEL the same way."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from partir_torch.errors import PartirError


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


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
    program = capture(model, inputs, loss_fn, optimizer, mode="inference" if args.inference else "train")
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
        f"{s['capture_time_s']:.2f} s — {s['ops']} ops ({', '.join(f'{k} {v}' for k, v in s['ops_by_phase'].items())}), "
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="partir-torch", description="Automatic SPMD partitioning for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("capture", help="capture a model's training step and summarize the program")
    c.add_argument("model", help="zoo name (e.g. gpt2-small; see `partir-torch models`) or path/to/file.py:factory")
    c.add_argument("--config", action="append", metavar="KEY=VALUE", help="override a model config field")
    c.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "none"])
    c.add_argument("--inference", action="store_true", help="capture the forward pass only")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--top", type=int, default=15, help="rows of the op table")
    c.set_defaults(fn=cmd_capture)

    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(fn=cmd_models)
    return p


def cmd_models(args: argparse.Namespace) -> int:
    from partir_torch import models

    for name in models.names():
        print(f"{name:14s} {models.config(name)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except PartirError as e:
        print(f"partir-torch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
