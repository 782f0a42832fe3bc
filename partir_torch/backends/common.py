"""What both backends do to a user's model and optimizer alike: find every tensor slot, and rebuild the
optimizer on the sharded parameters with the states torch.optim would create."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from partir_torch.errors import PartirError


def slots(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]]:
    """Every (module, attribute) that holds a parameter or buffer, ties included."""
    out = []
    for mod in model.modules():
        out += [(mod, n, p, True) for n, p in mod.named_parameters(recurse=False, remove_duplicate=False)]
        out += [(mod, n, b, False) for n, b in mod.named_buffers(recurse=False, remove_duplicate=False)
                if b is not None]
    return out


def initial_fills(opt: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor
                  ) -> dict[str, tuple[tuple[int, ...], float, torch.dtype]]:
    """The states torch.optim creates at the first step, as (shape, the constant it starts from, dtype), named
    and shaped as capture's `OptimizerSpec` says: zeros, Adagrad's `initial_accumulator_value`, NAdam's momentum
    product 1; SGD's buffer is the first gradient: zero momentum gives it too. (A backend makes each at the
    size it holds: a rank its part.)"""
    from partir_torch.capture.optim import CLASSES, optimizer_spec

    base = next(c for c in type(opt).__mro__ if c in CLASSES.values())  # (the backends' rebuilt subclasses)
    spec = optimizer_spec(base([{**group, "params": [p]}]), {"p": p})
    shared = {s: ((), 1.0 if s == "mu_product" else 0.0, torch.float32) for s in spec.shared_states}
    fill = group.get("initial_accumulator_value", 0.0)
    return {**shared, **{s: (tuple(shape), fill if s == "sum" else 0.0, p.dtype)
                         for s, shape in spec.state_shapes("p", tuple(p.shape)).items()}}


def initial_states(opt: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, dev) -> dict[str, torch.Tensor]:
    """`initial_fills`, made whole on `dev`."""
    return {s: torch.full(shape, fill, dtype=dtype, device=dev)
            for s, (shape, fill, dtype) in initial_fills(opt, group, p).items()}


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], params: dict[str, torch.Tensor],
                      cls: type | None = None, **options: Any) -> torch.optim.Optimizer:
    """A new optimizer of `optimizer`'s class, param groups and hyperparameters on `params` (by name; `names`
    maps the old parameters' ids to names), with `options` set where the class has them; of class `cls` (a
    subclass) when given."""
    groups = []
    for g in optimizer.param_groups:
        unknown = [p for p in g["params"] if id(p) not in names]
        if unknown:
            raise PartirError(f"the optimizer holds {len(unknown)} tensors that are not parameters of the model "
                           f"(shapes {[list(p.shape) for p in unknown[:3]]}); build it on model.parameters()")
        ng = {k: (options.get(k, v) if k in options else v) for k, v in g.items() if k != "params"}
        ng["params"] = [params[names[id(p)]] for p in g["params"]]
        groups.append(ng)
    accepted = inspect.signature(type(optimizer).__init__).parameters  # (defaults may hold more keys)
    defaults = {k: options.get(k, v) for k, v in optimizer.defaults.items() if k in accepted}
    return (cls or type(optimizer))(groups, **defaults)
