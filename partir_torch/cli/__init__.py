"""The `partir-torch` command line. Subcommands mirror the pipeline; each takes MODEL the same way."""

from __future__ import annotations

import sys

from partir_torch.cli.parser import OPTIMIZERS, build_parser
from partir_torch.cli.planning import parse_mesh
from partir_torch.errors import PartirError

__all__ = ["OPTIMIZERS", "build_parser", "main", "parse_mesh"]

# commands that start no runtime or worker: as a program (`main()` without arguments) they end the process
# without its teardown, which frees the search's millions of objects one by one (over a second for a 70B plan)
_FAST_EXIT = frozenset({"plan", "capture", "coverage", "models", "diff", "show"})


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

