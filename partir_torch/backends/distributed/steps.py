"""A sharded model's training step and forward on torch.distributed: the plan's rank programs run on the local
shards `engine.apply` made.

`step(model, optimizer, *batch)` runs the planned step on the global batch (or the rank's own part,
`local=True`) and writes the updated parameters and optimizer states back in place; the loss comes back
replicated. The model's own `forward` (`model(x)`, installed by `install_forward`) runs the plan's forward
program, its outputs replicated, in the structure the model returns. A batch of another shape, `accumulate=k`
microbatches, or a forward in either mode runs the plan's program made for it (`variants.py`), kept for the
next call. The first step compares the ranks' global batches: a rank that reads other data fails at once,
not silently.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from partir_torch import _compat
from partir_torch.backends.distributed.engine import (
    Sharded,
    check_batch,
    compiled,
    hyper_of,
    rank_inputs,
    require,
)
from partir_torch.backends.distributed.reshard import Exchange
from partir_torch.backends.distributed.runtime import DistributedError, RankMesh
from partir_torch.backends.distributed.variants import Built, Variant, build, capture_variant, replayed
from partir_torch.capture.opaque import TENSOR
from partir_torch.ir.program import Loop, Program
from partir_torch.propagate import ShardingState

log = logging.getLogger(__name__)


def install_forward(model: nn.Module) -> None:
    """The model's `forward` becomes the plan's (an instance attribute: `engine.unshard` deletes it)."""
    model.forward = _ShardedForward(model)


def program_for(rec: Sharded, model: nn.Module, optimizer: torch.optim.Optimizer | None, variant: Variant,
                batch: Sequence[torch.Tensor]) -> Built:
    """The plan's program for `variant` on this rank: captured, replayed and traced the first time (said in one
    line), then kept (`variants.py`)."""
    got = rec.variants.get(variant)
    if got is not None:
        return got
    t0 = time.perf_counter()
    with plain(model, rec):
        program = capture_variant(model, variant, batch, rec.loss_fn, optimizer, fallback=rec.fallback,
                                  compiling=rec.plan.compiling)
    state = replayed(rec.state, program)
    probe = rank_inputs(rec, model, optimizer, None, probe=True, state=state)
    built = build(state, Exchange(rec.rank_mesh.mesh, rec.rank_mesh.coord, rec.rank_mesh.groups), probe,
                  outputs=variant.kind == "forward", bucket_cap=rec.program.bucket_cap, compiled=rec.compiled)
    if rec.compiled:
        built.graph = compiled(built.graph)
    rec.variants[variant] = built
    if rec.rank_mesh.rank == 0:
        log.warning("partir_torch: the plan made %s for %s (%.1f s; kept for the next)",
                    "its program" if variant.kind == "step" else "a forward program", variant,
                    time.perf_counter() - t0)
    return built


class plain:
    """While inside: the model's own forward back (the capture runs it on fake tensors)."""

    def __init__(self, model: nn.Module, rec: Sharded) -> None:
        self.model, self.rec = model, rec

    def __enter__(self) -> None:
        self.saved = self.model.__dict__.pop("forward", None)

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            self.model.forward = self.saved


def step(model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor, local: bool = False,
         accumulate: int | None = None, divide: int | None = None,
         aux: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One training step of the sharded model (module docstring); returns the loss. `accumulate=k`: the batch's
    rows in k microbatches, one update (the plan's program for that, made the first time)."""
    rec = require(model)
    if optimizer is not rec.optimizer:
        raise DistributedError("this optimizer is not the one auto_shard returned for this model; pass that one")
    prog = rec.state.program
    groups = zip(rec.hyper, optimizer.param_groups)
    changed = [f"group {i} {k}: {was[k]} -> {now.get(k)}" for i, (was, g) in enumerate(groups)
               for now in [hyper_of(g)] for k in was if now.get(k) != was[k]]
    if changed:
        raise DistributedError("the optimizer's hyperparameters changed since the step was captured "
                               f"({'; '.join(changed[:4])}): the rank program holds every one but the learning rate "
                               "as a constant; keep them fixed (OneCycleLR / CyclicLR: cycle_momentum=False), or "
                               "shard again")
    loop = prog.loop if accumulate is None and divide is None else dataclasses.replace(
        prog.loop, accumulate=accumulate or prog.loop.accumulate, divide=divide)
    variant = Variant.of("step", batch, loop=loop)
    if not local and not rec.batch_checked:
        from partir_torch.backends.distributed.shard import same_tensors

        same_tensors(batch, "global batches", "every rank must pass the whole global batch, the same on every rank "
                     "(or local=True: each rank its own part, split as the plan splits it)")
        rec.batch_checked = True
    if loop == prog.loop and _fits(prog, rec.state, rec.rank_mesh, batch, local):
        state, graph = rec.state, rec.graph
    else:
        if local:
            check_batch(prog, rec.state, rec.rank_mesh, batch, local)  # (another shape needs the global batch)
        built = program_for(rec, model, optimizer, variant, batch)
        state, graph = built.state, built.graph
    prog = state.program
    flat = rank_inputs(rec, model, optimizer, batch, local=local, state=state)
    with torch.no_grad():
        outs = graph(*flat)
        loss = outs[0] if prog.loss is not None else None
        _write_back(prog, flat, outs[1 if loss is not None else 0:], optimizer)
        if aux is not None:  # the values the loss function returned beside the loss (one per microbatch)
            aux.update(zip(prog.aux, outs[len(outs) - len(prog.aux):]))
    rec.steps += 1
    optimizer._opt_called = True  # as torch.optim's step marks it for LR schedulers (their call-order check)
    return loss.detach() if loss is not None else None


def _fits(program: Program, state: ShardingState, rm: RankMesh, batch: Sequence[torch.Tensor], local: bool) -> bool:
    try:
        check_batch(program, state, rm, batch, local)
    except DistributedError:
        return False
    return True


def _write_back(prog: Program, flat: list[torch.Tensor], outs: Sequence[torch.Tensor],
                optimizer: torch.optim.Optimizer | None) -> None:
    """The updated values over their inputs' local tensors (unless donated: written in place already)."""
    where = dict(zip(prog._placeholder_ids(), flat))
    for (_new, old), t in zip(prog.updates.items(), outs):
        if t is not where[old] and t.data_ptr() != where[old].data_ptr():
            where[old].copy_(t)
    # torch.optim keeps a step counter (NAdam a momentum product) per parameter: all hold the program's one
    for s, v in prog.shared_states.items():
        for st in (optimizer.state.values() if optimizer is not None else ()):
            if s in st and st[s] is not where[v]:
                st[s].copy_(where[v])


class _ShardedForward:
    """The sharded model's `forward`: the plan's forward program for these inputs and the model's mode, its
    outputs replicated on every rank, in the structure the model returns (an HF `ModelOutput` too)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model()
        rec = require(model)
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            bad = ", ".join([*kwargs, *(f"argument {i} ({type(a).__name__})" for i, a in enumerate(args)
                                        if not isinstance(a, torch.Tensor))])
            raise DistributedError(f"a model sharded by partir_torch runs its forward on tensors passed "
                                   f"positionally; got {bad}: pass the tensors in forward's order")
        variant = Variant.of("forward", args, training=model.training, loop=_policy(rec.state.program.loop))
        built = program_for(rec, model, None, variant, args)
        prog = built.state.program
        flat = rank_inputs(rec, model, None, args, state=built.state)
        with torch.no_grad():
            outs = built.graph(*flat)
            _write_back(prog, flat, outs[:len(prog.updates)], None)  # train mode: BatchNorm's running statistics
        leaves = iter(outs[len(prog.updates):])
        spec, consts = prog.out_tree
        out = _compat.pytree.tree_unflatten([next(leaves) if c is TENSOR else _plain(c) for c in consts], spec)
        return _no_backward(out) if torch.is_grad_enabled() else out


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_said: set[str] = set()


def _plain(c: Any) -> Any:
    """A non-tensor output as the model returned it, or None for an object the forward filled with tensors of
    the capture (HF's `DynamicCache` of past keys and values): said once, never returned half-made."""
    if isinstance(c, _PLAIN) or (isinstance(c, tuple | list) and all(isinstance(x, _PLAIN) for x in c)):
        return c
    name = type(c).__name__
    if name not in _said:
        _said.add(name)
        log.warning("partir_torch: the sharded forward returns tensors and plain values; the model's %s output "
                    "is returned as None (an HF model: use_cache=False leaves it out)", name)
    return None


def _no_backward(out: Any) -> Any:
    """Outputs whose backward says how to train, instead of autograd's "does not require grad"."""
    anchor = torch.zeros((), requires_grad=True)  # (so that the outputs require grad, and their backward runs)
    return _compat.pytree.tree_map(lambda t: _NoBackward.apply(t, anchor) if isinstance(t, torch.Tensor)
                                   and t.is_floating_point() else t, out)


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise DistributedError("a model sharded by partir_torch on torch.distributed trains in one planned program "
                               "(forward, backward and update): `loss = partir_torch.step(model, optimizer, "
                               "*batch)`, not loss.backward(); its own forward is for evaluation")




def _policy(loop: Loop) -> Loop:
    """The mixed-precision policy of a step's loop, alone: what a forward of the same model runs under."""
    return Loop(param_dtype=loop.param_dtype, reduce_dtype=loop.reduce_dtype)
