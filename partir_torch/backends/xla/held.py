"""The torch_xla backend as the facade asks it (`backends.held.Engine`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from partir_torch.backends.xla.module import sharded, train_step, unshard
from partir_torch.backends.xla.runtime import XlaError


class XlaEngine:
    name = "xla"

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor, local: bool = False,
             accumulate: int | None = None) -> torch.Tensor:
        if local or accumulate not in (None, 1):
            raise XlaError("local=True and accumulate= are the torch backend's; on XLA pass the global batch, and "
                           "accumulate in your loop")
        return train_step(model, optimizer, sharded(model).loss_fn, batch)

    def unshard(self, model: nn.Module) -> nn.Module:
        return unshard(model)

    def verify(self, model: nn.Module, example_inputs: Any, *, plan=None, **kwargs: Any) -> Any:
        from partir_torch.backends.verify import verify

        return verify(plan if plan is not None else model.partir_plan, model, example_inputs, **kwargs)

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def load(self, model: nn.Module, path: Any, *, strict: bool = True) -> Any:
        raise XlaError("partir_torch.load reads shards on the torch backend; on XLA load the weights before "
                       "auto_shard (from_pretrained, load_state_dict): XLA shards them as it transfers them")
