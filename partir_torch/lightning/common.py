"""What both Lightning strategies share: the loss a `training_step` returns, the LR schedulers repointed at the
rebuilt optimizer, and `self.log` while the step is captured."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from partir_torch.errors import PartirError


def _loss_of(out: Any) -> torch.Tensor:
    loss = out["loss"] if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor):
        raise PartirError(f"training_step must return the loss tensor or a dict with 'loss', got {type(out).__name__}")
    return loss


def _repoint(strategy, template: torch.optim.Optimizer, opt: torch.optim.Optimizer) -> None:
    """The rebuilt optimizer replaces `configure_optimizers`' one, and its LR schedulers now schedule it."""
    strategy.optimizers = [opt]
    for config in strategy.lr_scheduler_configs:
        if getattr(config.scheduler, "optimizer", None) is template:
            config.scheduler.optimizer = opt
            _track_steps(opt)


def _track_steps(opt: torch.optim.Optimizer) -> None:
    """What an LR scheduler's constructor does to its optimizer (torch's call-order check reads it): its step
    marks `_opt_called` (`partir_torch.step` marks it on the torch backend, where this step is refused)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref, step = weakref.ref(opt), type(opt).step

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        me = ref()
        me._opt_called = True
        return step(me, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


class _Silenced:
    """`module.log` / `log_dict` recorded, not logged, while the step is captured on fake tensors: `logged`
    gets each name's value (a tensor of the capture, which the step then returns) and `how` its keywords
    (`prog_bar`, `on_epoch`, ...), for the strategy to log the step's real values."""

    def __init__(self, module: Any, logged: dict[str, Any] | None = None, how: dict[str, dict] | None = None
                 ) -> None:
        self.module = module
        self.logged = {} if logged is None else logged
        self.how = {} if how is None else how

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        if not isinstance(value, torch.Tensor | int | float):
            raise PartirError(f"self.log({name!r}, {type(value).__name__}) in training_step: on partir_torch's torch "
                              "backend the step's logged values are tensors it returns; log the metric's value "
                              "(a tensor), and a torchmetrics Metric object in validation_step")
        self.logged[name], self.how[name] = value, kwargs

    def log_dict(self, values: dict[str, Any], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)

    def __enter__(self) -> _Silenced:
        object.__setattr__(self.module, "log", self.log)
        object.__setattr__(self.module, "log_dict", self.log_dict)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in ("log", "log_dict"):
            self.module.__dict__.pop(name, None)
