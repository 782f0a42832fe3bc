"""partir_torch: automatic SPMD partitioning of PyTorch training steps (after PartIR).

Pipeline: capture -> ir -> rules -> propagate/lower -> cost -> search -> plan -> backends.

The facade's names are imported on first use (PEP 562), so that `import partir_torch.cache` (the CLI's
cached-repeat path, `partir_torch/cache.py`) does not import torch: `import torch` alone takes seconds.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# facade name -> the module that defines it
_FACADE = {
    "auto_shard": "partir_torch.api", "input_sharding": "partir_torch.api", "shard_batch": "partir_torch.api",
    "start_runtime": "partir_torch.api", "unshard": "partir_torch.api", "verify": "partir_torch.api",
    "step": "partir_torch.api",
    "capture": "partir_torch.capture",
    "CaptureError": "partir_torch.errors", "InputShapeError": "partir_torch.errors",
    "PartirError": "partir_torch.errors", "UnsupportedOptimizerError": "partir_torch.errors",
    "Group": "partir_torch.ir", "Op": "partir_torch.ir", "Phase": "partir_torch.ir", "Program": "partir_torch.ir",
    "Role": "partir_torch.ir", "Value": "partir_torch.ir",
    "ShardingPlan": "partir_torch.plan",
    "search": "partir_torch.search.api",
}
__all__ = ["CaptureError", "Group", "InputShapeError", "Op", "PartirError", "Phase", "Program", "Role", "ShardingPlan",
           "UnsupportedOptimizerError", "Value", "auto_shard", "capture", "input_sharding", "search", "shard_batch",
           "start_runtime", "step", "unshard", "verify"]

if TYPE_CHECKING:
    from partir_torch.api import auto_shard, input_sharding, shard_batch, start_runtime, step, unshard, verify
    from partir_torch.capture import capture
    from partir_torch.errors import CaptureError, InputShapeError, PartirError, UnsupportedOptimizerError
    from partir_torch.ir import Group, Op, Phase, Program, Role, Value
    from partir_torch.plan import ShardingPlan
    from partir_torch.search.api import search


def __getattr__(name: str) -> Any:
    if name == "launch":  # `partir_torch.launch.spawn(...)` without importing the submodule first
        return importlib.import_module("partir_torch.launch")
    module = _FACADE.get(name)
    if module is None:
        raise AttributeError(f"module 'partir_torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FACADE})


class _Facade(types.ModuleType):
    """`partir_torch.capture` and `partir_torch.search` are the functions, as they were when the facade was
    imported eagerly: importing the subpackages of the same names must not rebind them to the modules."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FACADE and isinstance(value, types.ModuleType):
            return  # the import system binding a subpackage; `sys.modules` has it
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
