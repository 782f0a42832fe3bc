"""partir_torch: automatic SPMD partitioning of PyTorch training steps (after PartIR).

Pipeline: capture -> ir -> rules -> propagate/lower -> cost -> search -> plan -> backends.

The facade is the user's verbs, and shadows no subpackage:

    model, opt = partir_torch.auto_shard(model, batch, {"batch": 2, "model": 4}, loss_fn=loss, optimizer=opt)
    loss = partir_torch.step(model, opt, *batch)             # one training step, on either backend
    plan = partir_torch.find_plan(model, batch, mesh, loss_fn=loss)   # the plan alone (a `ShardingPlan`)
    partir_torch.verify(model, batch)                        # the engine's program against the plan
    partir_torch.unshard(model)                              # the trained values back in the caller's tensors

with `shard_batch` and `start_runtime` (torch_xla), `ShardingPlan` (load, save, read a plan) and `PartirError`
(every error it raises). The stages are their subpackages: `partir_torch.capture.capture`,
`partir_torch.search.search` (what `find_plan` is), `partir_torch.ir`, `partir_torch.tactics`, ...

The names are imported on first use (PEP 562), so that `import partir_torch.cache` (the CLI's cached-repeat
path) does not import torch: `import torch` alone takes seconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# facade name -> (the module that defines it, its name there)
_FACADE = {
    "auto_shard": ("partir_torch.api", "auto_shard"),
    "step": ("partir_torch.api", "step"),
    "load": ("partir_torch.api", "load"),
    "find_plan": ("partir_torch.search.api", "search"),
    "verify": ("partir_torch.api", "verify"),
    "unshard": ("partir_torch.api", "unshard"),
    "shard_batch": ("partir_torch.api", "shard_batch"),
    "start_runtime": ("partir_torch.api", "start_runtime"),
    "ShardingPlan": ("partir_torch.plan", "ShardingPlan"),
    "PartirError": ("partir_torch.errors", "PartirError"),
}
__all__ = ["PartirError", "ShardingPlan", "auto_shard", "find_plan", "load", "shard_batch", "start_runtime", "step",
           "unshard", "verify"]

if TYPE_CHECKING:
    from partir_torch.api import auto_shard, load, shard_batch, start_runtime, step, unshard, verify
    from partir_torch.errors import PartirError
    from partir_torch.plan import ShardingPlan
    from partir_torch.search.api import search as find_plan


def __getattr__(name: str) -> Any:
    where = _FACADE.get(name)
    if where is None:
        if name.startswith("__"):
            raise AttributeError(f"module 'partir_torch' has no attribute {name!r}")
        try:  # a subpackage or module not imported yet (`partir_torch.launch.spawn(...)`)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'partir_torch' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FACADE})
