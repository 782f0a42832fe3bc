"""The user's front door: `auto_shard` (plan, then apply), `step`, `unshard`, `shard_batch`, `verify`.

    model, opt = partir_torch.auto_shard(model, (tokens, targets), {"batch": 2, "model": 4},
                                         loss_fn=lm_loss, optimizer=torch.optim.AdamW(model.parameters()))
    for tokens, targets in loader:
        loss = partir_torch.step(model, opt, tokens, targets)   # every rank passes the global batch

constraints -> optimize -> apply: the plan comes from `search()` (or a saved plan / a `ShardingPlan`), is
checked against the model and mesh, and is applied by a backend: `torch` (`backends/distributed`: the plan
run as an explicit per-rank program on torch.distributed, CUDA/NCCL or CPU/gloo, one process a device) or
`xla` (`backends/xla.py`: torch_xla SPMD in one process). Until the last step succeeds nothing of the
caller's model or optimizer is changed.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from partir_torch.errors import PartirError
from partir_torch.ir.mesh import Mesh, parse_mesh
from partir_torch.options import Options
from partir_torch.plan import ShardingPlan

log = logging.getLogger(__name__)


def checked_plan(model: nn.Module, example_inputs: Sequence[torch.Tensor] | torch.Tensor, mesh, *,
                 loss_fn: Callable[..., torch.Tensor], optimizer, options: Options,
                 plan: ShardingPlan | str | os.PathLike | None = None) -> tuple[ShardingPlan, Mesh]:
    """The plan `auto_shard` applies: searched with `options`, or the one given (a `ShardingPlan` or a saved
    plan's path), checked against the model, its example inputs and the mesh."""
    m, dcn = parse_mesh(mesh)
    if plan is None:
        from partir_torch.search.api import search

        plan = search(model, example_inputs, m, loss_fn=loss_fn, optimizer=optimizer, options=options, dcn_axes=dcn)
    elif not isinstance(plan, ShardingPlan):
        plan = ShardingPlan.load(plan)
    plan.check(model, example_inputs, mesh=dict(m.axes))
    return plan, m


BACKENDS = ("torch", "xla")


def choose_backend(backend: str | None) -> str:
    """`backend` checked, or the default: `torch` (torch.distributed, on every torch release partir_torch
    supports). `xla` is asked for by name, and needs the XLA environment (torch 2.9.0 with torch_xla 2.9.0)."""
    if backend is None:
        return "torch"
    if backend not in BACKENDS:
        raise PartirError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}: 'torch' "
                          "runs the plan on torch.distributed (GPUs, CPUs, TorchTPU), 'xla' on torch_xla SPMD")
    if backend == "xla":
        require_xla()
    return backend


def require_xla() -> None:
    """The torch_xla backend's environment, or the command that makes it."""
    import importlib.util

    from partir_torch.backends.xla.runtime import INSTALL

    try:
        found = importlib.util.find_spec("torch_xla") is not None
    except ValueError:  # (a module entry set to None: treated as not installed, as import is)
        found = False
    if not found:
        raise PartirError(f"backend='xla' needs torch_xla, which is not installed (torch {torch.__version__}). "
                          f"{INSTALL}. The torch backend (backend='torch', the default) needs nothing more.")


def auto_shard(model: nn.Module, example_inputs: Sequence[torch.Tensor] | torch.Tensor, mesh, *,
               loss_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer, options: Options | None = None,
               plan: ShardingPlan | str | os.PathLike | None = None, backend: str | None = None,
               compile: bool = False, init_fn: Callable[[nn.Module], None] | None = None,
               **overrides: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Shard `model`'s training step over `mesh` and return `(model, optimizer)` to train with.

    `mesh`: `{"batch": 2, "model": 4}`, `"batch=2:dcn,model=4"` or a `Mesh`. `loss_fn(model, *inputs)` is the
    scalar loss of one step on `example_inputs` (targets are inputs too). `optimizer`: the user's
    torch.optim optimizer on `model.parameters()`; a new one of the same class, groups and hyperparameters
    is returned on the sharded parameters, its states sharded as the plan says. `options` and keywords named
    like its fields (`schedule`, `hardware` — None: the preset of the accelerator found —, `memory`, `budget`,
    `seed`, `fallback`, `cache`, `assume_compiling`, ...; `options.py`) are `find_plan`'s; `plan` skips the
    search (a `ShardingPlan` or the path of a saved one).

    `backend` (`choose_backend`): "torch" (the default) runs in every rank of a torch.distributed job
    (torchrun, or `partir_torch.launch.spawn`): rank 0 plans, every rank checks it holds the same plan, parameters and
    optimizer states become DTensors, and `partir_torch.step(model, optimizer, *batch)` runs a step
    (`compile=True`: through torch.compile). "xla" applies the plan with torch_xla SPMD in this process
    (the model is moved to the XLA device; the plain loop or `step` trains it). `partir_torch.unshard(model)`
    undoes either; the plan is `model.partir_plan`.

    A model built on the meta device (too large for one rank) is planned as any model and, on the torch
    backend, each rank initializes only its own parts, module by module: `reset_parameters()`, or
    `init_fn(module)` filling that module's own tensors (`backends/distributed/materialize.py`); then
    `partir_torch.load(model, path)` reads pretrained weights shard-wise.
    """
    if not isinstance(model, nn.Module):
        raise PartirError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    opts = Options.of(options, **overrides)
    backend = choose_backend(backend)
    from partir_torch.backends.held import held_by

    if held_by(model) is not None:
        raise PartirError(f"{type(model).__name__} is already sharded by partir_torch; call "
                          "partir_torch.unshard(model) first to plan and shard it again")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PartirError(f"optimizer must be your torch.optim optimizer built on model.parameters() (it is "
                          f"rebuilt on the sharded parameters), got {optimizer!r}")
    from partir_torch.capture.optim import optimizer_spec

    optimizer_spec(optimizer, dict(model.named_parameters()))  # an unsupported optimizer fails before the search
    if backend == "torch":
        from partir_torch.backends.distributed import shard

        if not isinstance(plan, (ShardingPlan, type(None))):
            plan = str(plan)
        model, opt = shard.auto_shard(model, example_inputs, mesh, loss_fn=loss_fn, optimizer=optimizer, plan=plan,
                                      compile=compile, options=opts, init_fn=init_fn)
        log.info("partir_torch: sharded %s over %s on torch.distributed\n%s", type(model).__name__, mesh,
                 model.partir_plan.table())
        _warn_scheduler(optimizer)
        return model, opt
    if init_fn is not None:
        raise PartirError("init_fn (initializing a meta model's parts on each rank) is the torch backend's: use "
                          "backend='torch', or build the model with weights")
    if compile:
        raise PartirError("compile=True is the torch backend's (torch.compile of the rank program); torch_xla "
                          "compiles the step itself: drop compile, or use backend='torch'")
    from partir_torch.backends import xla

    m, _ = parse_mesh(mesh)
    note = xla.start_runtime(m.devices)  # before the capture's backward: see `xla._probe_autograd`
    if note:
        print(note, file=sys.stderr)
    if opts.hardware is None:
        opts = Options.of(opts, hardware=xla.hardware_preset())
    the_plan, m = checked_plan(model, example_inputs, mesh, loss_fn=loss_fn, optimizer=optimizer, options=opts,
                               plan=plan)
    opt = xla.apply(model, optimizer, the_plan, xla.device_mesh(m, the_plan.dcn_axes), loss_fn=loss_fn)
    log.info("partir_torch: sharded %s over %s\n%s", type(model).__name__, m, the_plan.table())
    _warn_scheduler(optimizer)
    return model, opt


def _warn_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """An LR scheduler built on the optimizer passed in would go on scheduling it, not the one returned."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):  # (what torch's LRScheduler marks its optimizer with)
        warnings.warn("an LR scheduler was built on the optimizer passed to auto_shard: it changes that optimizer's "
                      "learning rate, and the returned optimizer trains the model; build the scheduler on the "
                      "returned optimizer, or point it there (`scheduler.optimizer = optimizer`)", stacklevel=3)


def _engine(model: nn.Module):
    """The engine holding `model` (`backends.held`), or an error saying to shard it first."""
    from partir_torch.backends.held import held_by

    engine = held_by(model)
    if engine is None:
        raise PartirError(f"{type(model).__name__} is not sharded: call partir_torch.auto_shard first")
    return engine


def step(model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor, local: bool = False,
         accumulate: int | None = None) -> torch.Tensor:
    """One training step of a model `auto_shard` sharded, on the global batch (every rank passes all of it;
    `local=True`: each rank passes its own part as the plan splits it, torch backend only); returns the loss,
    a scalar tensor. On the torch backend the step is the plan's rank program; on XLA, the plain loop.
    `accumulate=k` (torch backend): the batch's rows in k microbatches, their gradients averaged, one update
    (the default: `Options.accumulate`, what the plan was made for); a batch of another shape than the example
    runs the same plan made again for it, kept for the next."""
    return _engine(model).step(model, optimizer, *batch, local=local, accumulate=accumulate)


def load(model: nn.Module, path, *, strict: bool = True):
    """Pretrained weights into a model `auto_shard` sharded (torch backend): a `.safetensors` file or a
    directory as `save_pretrained` writes it, or a DCP checkpoint; each rank reads only its own slices. Keys
    are the model's `state_dict()` names; missing or unexpected keys and other shapes are errors that name
    them, the model untouched (`strict=False`: load what matches, warn about the rest). Returns what this
    rank read (`backends.distributed.load.Loaded`)."""
    return _engine(model).load(model, path, strict=strict)


def start_runtime(mesh) -> None:
    """Start torch_xla's SPMD runtime for `mesh` now. `auto_shard` does it itself; call this first when the
    process runs a backward (a capture, `search()`, CPU training) before `auto_shard`: PyTorch sizes
    autograd's per-device queues at the first backward of a process, and an XLA backward needs them."""
    from partir_torch.backends import xla

    note = xla.start_runtime(parse_mesh(mesh)[0].devices)
    if note:
        print(note, file=sys.stderr)


def unshard(model: nn.Module) -> nn.Module:
    """Undo `auto_shard`: the model's own parameter and buffer objects back, holding the trained values, its
    hooks removed, `partir_plan` gone. The optimizer `auto_shard` returned is not usable after this."""
    return _engine(model).unshard(model)


def shard_batch(model: nn.Module, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A batch of the step's inputs (in `example_inputs`' order, targets included) on the device with the
    plan's shardings. Inputs that reach `model.forward` directly are sharded by its hook anyway; targets
    that only the loss reads need this (or they run replicated)."""
    from partir_torch.backends import xla

    return xla.shard_batch(model, *batch)


def verify(model: nn.Module, example_inputs, *, plan: ShardingPlan | None = None, **kwargs: Any):
    """Hold what the engine runs against the plan's prediction: collectives by kind and mesh axis, per-device
    memory, and (`steps`, `numerics`) the losses against the unsharded step. On the torch backend the rank
    program's own collectives and memory (`backends.distributed.verify`); on XLA its compiled HLO
    (`backends.verify.verify`; `kwargs` go there; `plan` default: `model.partir_plan`; a model not sharded is
    verified against `plan` with `loss_fn=` and `optimizer=`)."""
    from partir_torch.backends.held import held_by

    engine = held_by(model)
    if engine is not None:
        return engine.verify(model, example_inputs, **({"plan": plan} if plan is not None else {}), **kwargs)
    from partir_torch.backends.verify import verify as verify_plan

    if plan is None:
        raise PartirError("this model has no plan: shard it with auto_shard, or call partir_torch.verify(model, "
                          "inputs, plan=plan, loss_fn=..., optimizer=...)")
    return verify_plan(plan, model, example_inputs, **kwargs)


def input_sharding(plan: ShardingPlan, i: int):
    """torch_xla's sharding of input `i` of `plan` (for `MpDeviceLoader(..., input_sharding=...)`)."""
    from partir_torch.backends import xla

    return xla.input_sharding(plan, i)
