"""The torch.distributed backend: a plan run as an explicit per-rank program (`rank.py`) with the plan's
collectives as functional collectives (`reshard.py`, the steps of `layout.walk`), on DTensor parameters and
optimizer states (`engine.py`), planned once and agreed on by every rank (`shard.py`), launched by torchrun
or `launch.spawn` (`runtime.py`, `launch.py`), measured as it runs (`measure.py`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class TorchEngine:
    """The torch backend as the facade asks it (`backends.held.Engine`)."""

    name = "torch"

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor, local: bool = False,
             accumulate: int | None = None) -> torch.Tensor:
        from partir_torch.backends.distributed import steps

        return steps.step(model, optimizer, *batch, local=local, accumulate=accumulate)

    def unshard(self, model: nn.Module) -> nn.Module:
        from partir_torch.backends.distributed import engine

        return engine.unshard(model)

    def verify(self, model: nn.Module, example_inputs: Any, *, plan=None, **kwargs: Any) -> Any:
        from partir_torch.backends.distributed.verify import verify
        from partir_torch.errors import PartirError

        if plan is not None and plan is not getattr(model, "partir_plan", None):
            raise PartirError("the torch backend verifies the plan it runs (model.partir_plan); to verify another "
                              "plan, shard with it: auto_shard(..., plan=plan)")
        return verify(model, example_inputs, **kwargs)

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self, model: nn.Module, path: Any, *, strict: bool = True) -> Any:
        from partir_torch.backends.distributed.load import load

        return load(model, path, strict=strict)
