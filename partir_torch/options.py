"""`Options`: how to plan, one frozen type that every entry point shares, with every default in one place.

`find_plan` (`search.api.search`), `auto_shard`, the Lightning strategies and the CLI's `plan`, `train` and
`simulate` take the same options: as an `Options` (`options=Options(budget="30s")`), as keywords of the same
names (`budget="30s"`, which override the `options` given), or as the CLI's flags, which are generated from
the fields below (`add_flags`: `--budget`, `--no-fold`, ...). What an entry point needs beyond them is its own
argument: the model, example inputs, loss, optimizer and mesh (a cross-node axis is marked in the mesh:
`batch=4:dcn`), a saved `plan`, the `backend`.

This module imports nothing of the package but its errors: the CLI builds its parser before torch is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from partir_torch.errors import PartirError

if TYPE_CHECKING:
    from partir_torch.cost.hardware import Hardware

DEFAULT_HARDWARE = "cpu-virtual"  # the cost model's preset where none is given and no accelerator says otherwise
ALGORITHMS = ("mcts", "random", "greedy", "beam", "exhaustive")


def _opt(default: Any, help: str, *, flag: str | None = None, choices: Iterable[str] | None = None,
         metavar: str | None = None) -> Any:
    """A field with its CLI help; `flag`: the flag when it is not `--name` (`--no-fold` for a True default;
    "" for none). The default is immutable (None, a bool, a number, a text)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "metavar": metavar})


@dataclass(frozen=True)
class Options:
    """How to plan and apply a plan. Every field has its default here and only here."""

    schedule: str | None = _opt(None, 'tactics per axis, e.g. "batch:BatchParallel;model:Auto" (default: search '
                                      'every axis, "*:Auto"); Auto(goal) with goal time|communication|zero')
    goal: str = _opt("time", "what the search of the schedule's default Auto minimizes", choices=("time",
                     "communication", "zero"))
    hardware: str | Hardware | None = _opt(  # noqa: RUF009
        None, f"cost model preset, or a `cost.Hardware` (default: the accelerator's, else {DEFAULT_HARDWARE})")
    memory: str | float | None = _opt(None, "per-device memory limit overriding the preset, e.g. 16GiB",
                                      metavar="BYTES")
    budget: str | int | None = _opt(None, "search budget: seconds (30s, 2m) or episodes (500); default: 200 "
                                          "episodes, the same plan on every run")
    seed: int = _opt(0, "the search's random seed")
    algorithm: str = _opt("mcts", "the search algorithm (the others are baselines)", choices=ALGORITHMS)
    fallback: bool = _opt(False, "run ops without a tile-mapping rule replicated (one warning per op with its "
                                 "module and the communication it adds) instead of stopping, and capture a "
                                 "submodule with data-dependent shapes (MoE routing) as one such op; "
                                 "`partir-torch coverage` lists them")
    fold: bool = _opt(True, "capture every repeated layer (slower; same costs)", flag="--no-fold")
    cache: bool = _opt(True, "bypass the plan cache ($XDG_CACHE_HOME/partir_torch): search, and store nothing",
                       flag="--no-cache")
    progress: bool | str | None = _opt(None, "search progress: a live bar on a terminal, a line every few seconds "
                                             "where stderr is piped or logged (None); False: nothing; 'bar' / "
                                             "'lines' either one", flag="")
    assume_compiling: bool = _opt(False, "capture with torch.compiler.is_compiling() true, so libraries skip "
                                         "data-dependent checks they skip under torch.compile (HF transformers' "
                                         "SDPA attention-mask check)")
    devices: int | None = _opt(None, "the device count the mesh must span (checked before the capture)")
    # the training loop's asks, in the planned step (its memory and collectives costed with them)
    accumulate: int = _opt(1, "microbatches per step: the batch's rows in this many, run one after another, their "
                              "gradients averaged before one update (a step's memory is one microbatch's)")
    max_grad_norm: float | None = _opt(None, "clip the gradients by their global 2-norm before the update, as "
                                             "torch.nn.utils.clip_grad_norm_ (over every shard)", metavar="NORM")
    max_grad_value: float | None = _opt(None, "clip each gradient element to [-v, v] before the update, as "
                                              "torch.nn.utils.clip_grad_value_", metavar="V")
    # mixed precision, FSDP2's MixedPrecisionPolicy (the casts are part of the captured step, costed at their dtypes)
    param_dtype: str | None = _opt(None, "compute forward and backward in this dtype (bfloat16, float16): the floating "
                                         "parameters stay as they are, the optimizer's master copy, and are cast "
                                         "for the step, with the model's floating inputs", metavar="DTYPE")
    reduce_dtype: str | None = _opt(None, "reduce the gradients in this dtype (float32: FSDP2's usual choice) "
                                          "before their cast back; default: in param_dtype", metavar="DTYPE")
    remat: str | None = _opt(None, "activation checkpointing of every repeated block (full: its forward run again in "
                                   "backward; selective: the same, its matmul and attention outputs kept; auto: "
                                   "the search plans each way, none included, and keeps the best that fits), part "
                                   "of the step the plan is searched and costed on",
                             choices=("full", "selective", "auto"))
    # how the torch backend runs the plan (the cost model counts its calls the same way)
    bucket_cap: str | int = _opt("25MiB", "the torch backend's reduction buckets: reductions of one kind, mesh axis "
                                          "and dtype issued as one collective up to this many bytes (DDP's "
                                          "gradient buckets)", metavar="BYTES")
    # ablations (benchmarks/search.py): no propagation-based pruning of actions / no per-axis goals
    prune: bool = _opt(True, "ablation: offer every syntactically possible action", flag="")
    goals: bool = _opt(True, "ablation: one joint tree for the plain step time", flag="")

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise PartirError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.progress not in (None, True, False, "bar", "lines"):
            raise PartirError(f"progress must be None, True, False, 'bar' or 'lines', got {self.progress!r}")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise PartirError(f"accumulate must be a whole number of microbatches >= 1, got {self.accumulate!r}")
        if self.remat not in (None, "full", "selective", "auto"):
            raise PartirError(f"remat must be 'full', 'selective', 'auto' or None, got {self.remat!r}")
        if not _positive_bytes(self.bucket_cap):
            raise PartirError(f"bucket_cap must be a positive size (25MiB, 4096), got {self.bucket_cap!r}")
        for name in ("max_grad_norm", "max_grad_value"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and not isinstance(v, bool) and v > 0):
                raise PartirError(f"{name} must be a positive number (None: no clipping), got {v!r}")
        if self.param_dtype is not None or self.reduce_dtype is not None:  # (torch is imported only then)
            from partir_torch.ir.program import Loop

            policy = Loop(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)  # (names, checked)
            object.__setattr__(self, "param_dtype", policy.param_dtype)
            object.__setattr__(self, "reduce_dtype", policy.reduce_dtype)

    @classmethod
    def of(cls, options: Options | None = None, **overrides: Any) -> Options:
        """`options` (None: the defaults) with `overrides` (keywords named like the fields) applied; an unknown
        keyword is an error that names the closest field."""
        base = options if options is not None else cls()
        if not isinstance(base, Options):
            raise PartirError(f"options must be a partir_torch.options.Options, got {type(base).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for k in overrides:
            if k not in names:
                near = difflib.get_close_matches(k, names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise PartirError(f"unknown option {k!r}{hint} (the options: {', '.join(names)})")
        return dataclasses.replace(base, **overrides) if overrides else base

    def planning(self) -> dict[str, Any]:
        """The fields that decide the plan (not how it is shown or whether the cache is read): a cache key's."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("progress", "cache")}


def _positive_bytes(value: Any) -> bool:
    import re

    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value > 0
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", str(value))
    return bool(m) and float(m.group(1)) > 0


def add_flags(parser: argparse.ArgumentParser, only: Iterable[str] | None = None) -> None:
    """The CLI flags of `Options`' fields (`only` these), each stored under the field's name."""
    only = None if only is None else set(only)
    for f in dataclasses.fields(Options):
        if (only is not None and f.name not in only) or f.metadata.get("flag") == "":
            continue
        meta, help = f.metadata, f.metadata["help"]
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        if f.default is True:  # --no-fold: stores False under `fold`
            parser.add_argument(flag, dest=f.name, action="store_false", help=help)
        elif f.default is False:
            parser.add_argument(flag, dest=f.name, action="store_true", help=help)
        else:
            kind = {"int": int, "int | None": int, "float | None": float}.get(f.type)
            parser.add_argument(flag, dest=f.name, default=f.default, type=kind, choices=meta["choices"],
                                metavar=meta["metavar"], help=help)


def from_args(args: argparse.Namespace) -> Options:
    """The `Options` of a command line parsed with `add_flags` (the fields it has flags for)."""
    return Options.of(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options) if hasattr(args, f.name)})
