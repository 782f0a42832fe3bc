"""The programs of a sharded model beyond its planned step, each from the same plan.

`auto_shard` applies a plan made for one step: one batch shape, one loss, one optimizer update. A training
loop asks for more: the model's own forward for evaluation (train or eval mode; logits, HF `ModelOutput`s),
a last batch of another size, k microbatches accumulated into one update, gradients clipped by their global
norm. Each is a program of its own, captured again for what it is asked (`capture(mode="inference")` for the
forward, `capture(loop=Loop(...))` for accumulation and clipping, the new shapes), and the plan's decisions
are replayed on it: a plan is its actions (the batch's tiles move to dim 1 when the step takes its
microbatches stacked, `capture/loop.py`; a forward's inputs are the model's arguments; a ZeRO-3 move holds a
forward's parameters split and gathers them where they are read, as in the step). The parameters, buffers and
optimizer states stay where the plan put them: a replay that would hold any of them otherwise, or a batch dim
the plan splits that no longer divides, is an error naming it. Each program is traced once into a rank graph
(`rank.trace`) and kept by what it was made for (`Variant`); the first of each kind is said in one line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from partir_torch.backends.distributed.rank import RankProgram, trace
from partir_torch.backends.distributed.reshard import Exchange
from partir_torch.backends.distributed.runtime import DistributedError
from partir_torch.errors import IllegalActionError, PartirError
from partir_torch.ir.actions import Action, ShardOptimizer, Tile
from partir_torch.ir.program import Loop, Program
from partir_torch.propagate import ShardingState

log = logging.getLogger(__name__)


class Undivided(DistributedError):
    """A batch whose dims the plan splits do not divide."""


@dataclass(frozen=True)
class Variant:
    """What a program is made for: the step (`loop`: microbatches, clipping) or the model's forward in one mode,
    on batch tensors of these global shapes and dtypes."""

    kind: str  # "step" | "forward"
    shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    training: bool = True
    loop: Loop = field(default_factory=Loop)

    @classmethod
    def of(cls, kind: str, batch: Sequence[torch.Tensor], *, training: bool = True, loop: Loop | None = None
           ) -> Variant:
        return cls(kind, tuple((tuple(x.shape), x.dtype) for x in batch), training, loop or Loop())

    def __str__(self) -> str:
        shapes = ", ".join(str(list(s)) for s, _ in self.shapes)
        if self.kind == "forward":
            return f"the forward in {'train' if self.training else 'eval'} mode on [{shapes}]"
        return f"the step on [{shapes}]" + ("" if self.loop == Loop() else f" ({self.loop})")


@dataclass
class Built:
    """One program of the plan on this rank: its state, its rank program and the traced graph."""

    state: ShardingState
    program: RankProgram
    graph: Any  # the traced GraphModule (or its compiled wrapper)


def translated(actions: Sequence[Action], source: Program, target: Program) -> list[Action]:
    """The plan's actions as they read on `target`: inputs renamed to the forward's arguments (a forward) or
    their tiles moved to dim 1 (microbatches stacked); ZeRO moves left for `zero_params` on a forward."""
    out: list[Action] = []
    forward = target.mode == "inference"
    stacked = target.loop.accumulate > 1
    for a in actions:
        if isinstance(a, ShardOptimizer):
            if not forward:
                out.append(a)
            continue
        if isinstance(a, Tile) and a.target.startswith("inputs["):
            i = int(a.target[len("inputs["):-1])
            if forward:
                arg = source.input_args[i] if i < len(source.input_args) else None
                if not isinstance(arg, int):
                    continue  # an input the forward does not take (the targets)
                a = Tile(f"inputs[{arg}]", a.dim, a.axis)
            elif stacked:
                a = Tile(a.target, a.dim + 1, a.axis)
        out.append(a)
    return out


def replayed(plan_state: ShardingState, program: Program) -> ShardingState:
    """The plan's decisions (those of `plan_state`) on `program`, checked to keep every parameter, buffer and
    optimizer state where the plan keeps them."""
    state = ShardingState(program, plan_state.mesh, fallback=plan_state.analysis.fallback)
    for axis in plan_state.mesh.names:  # what the model holds whole on an axis stays so (propagation stops there)
        state.lock([v for _, v, w in _held(program, plan_state.program) if axis not in plan_state.shard[w].axes],
                   axis)
    for a in translated(plan_state.actions, plan_state.program, program):
        try:
            state.apply(a)
        except IllegalActionError as e:
            raise _undivided(a, program, plan_state, e) from None
    if program.mode == "inference":
        zero_params(state, plan_state)
    _check_held(state, plan_state)
    return state


def _undivided(a: Action, program: Program, plan_state: ShardingState, e: Exception) -> PartirError:
    if isinstance(a, Tile) and a.target.startswith("inputs["):
        i = int(a.target[len("inputs["):-1])
        shape = program.values[program.inputs[i]].shape
        d = a.dim - (1 if program.loop.accumulate > 1 and program.mode == "train" else 0)
        size = plan_state.mesh.size(a.axis)
        return Undivided(
            f"batch tensor {i} has {shape[a.dim]} at dim {d}, which the plan splits over {a.axis!r} ({size} "
            f"devices, and any axis before it): pass batches whose dim {d} it divides, e.g. "
            f"DataLoader(..., drop_last=True) for a last batch of another size ({e})")
    return DistributedError(f"the plan's {a} does not apply to {program.mode} program of these shapes: {e}")


def zero_params(state: ShardingState, plan_state: ShardingState) -> None:
    """A forward's parameters held as the step holds them where a ZeRO-3 move split them: fenced on the axis,
    gathered where they are read, stored tiled (`propagate.zero`, without optimizer states to tile)."""
    from partir_torch.propagate.zero import hold_split

    prog, plan_prog = state.program, plan_state.program
    for a in plan_state.actions:
        if not (isinstance(a, ShardOptimizer) and a.stage == 3):
            continue
        dims = {}
        for name, pv in prog.params.items():
            want = plan_state.shard[plan_prog.params[name]]
            d = want.dim_of(a.axis)
            if d is not None and a.axis not in state.shard[pv].axes:
                dims[name] = d
        if dims:
            hold_split(state, a.axis, dims)


def _held(prog: Program, plan_prog: Program) -> list[tuple[str, int, int]]:
    """(name, value here, value in the plan's program) of what the model holds: parameters, buffers, states."""
    pairs = [(n, prog.params[n], plan_prog.params[n]) for n in prog.params if n in plan_prog.params]
    pairs += [(n, prog.buffers[n], plan_prog.buffers[n]) for n in prog.buffers if n in plan_prog.buffers]
    pairs += [(f"opt.{s}[{n}]", v, plan_prog.opt_states[n][s]) for n, st in prog.opt_states.items()
              for s, v in st.items() if s in plan_prog.opt_states.get(n, {})]
    return pairs


def _check_held(state: ShardingState, plan_state: ShardingState) -> None:
    prog = state.program
    moved = [f"{n} ({state.shard[v]} here, {plan_state.shard[w]} as applied)"
             for n, v, w in _held(prog, plan_state.program) if state.shard[v] != plan_state.shard[w]]
    if moved:
        raise DistributedError(f"the plan replayed on this {prog.mode} program would hold {len(moved)} tensor(s) "
                               f"elsewhere than the model holds them: {'; '.join(moved[:3])}; shard again for "
                               "this program (partir_torch.unshard, then auto_shard with its example inputs)")


def capture_variant(model: nn.Module, variant: Variant, batch: Sequence[torch.Tensor], loss_fn, optimizer, *,
                    fallback: bool, compiling: bool) -> Program:
    """The program of `variant`, captured on the sharded model itself (its parameters' global shapes are what
    the capture reads; no value is)."""
    from partir_torch.capture import capture

    if variant.kind == "forward":
        with training(model, variant.training):
            return capture(model, tuple(batch), None, None, mode="inference", fold=False, fallback=fallback,
                           assume_compiling=compiling, loop=variant.loop)
    return capture(model, tuple(batch), loss_fn, optimizer, fold=False, fallback=fallback,
                   assume_compiling=compiling, loop=variant.loop)


@contextlib.contextmanager
def training(model: nn.Module, mode: bool) -> Iterator[None]:
    """The model in train or eval mode while inside, as it was after."""
    was = [m.training for m in model.modules()]
    model.train(mode)
    try:
        yield
    finally:
        for m, t in zip(model.modules(), was):
            m.training = t


def build(state: ShardingState, exchange: Exchange, probe: list[torch.Tensor], *, outputs: bool,
          bucket_cap: int | None, compiled: bool = False) -> Built:
    program = RankProgram(state, exchange, outputs=outputs, bucket_cap=bucket_cap, compiled=compiled)
    return Built(state, program, trace(program, probe))
