"""partir_torch: automatic SPMD partitioning of PyTorch training steps (after PartIR).

Pipeline: capture -> ir -> rules -> propagate/lower -> cost -> search -> plan -> backends.
"""

from partir_torch.api import auto_shard, input_sharding, shard_batch, start_runtime, unshard, verify
from partir_torch.capture import capture
from partir_torch.errors import CaptureError, InputShapeError, PartirError, UnsupportedOptimizerError
from partir_torch.ir import Group, Op, Phase, Program, Role, Value
from partir_torch.plan import ShardingPlan
from partir_torch.search.api import search

__all__ = [
    "CaptureError",
    "Group",
    "InputShapeError",
    "Op",
    "PartirError",
    "Phase",
    "Program",
    "Role",
    "ShardingPlan",
    "UnsupportedOptimizerError",
    "Value",
    "auto_shard",
    "capture",
    "input_sharding",
    "search",
    "shard_batch",
    "start_runtime",
    "unshard",
    "verify",
]
__version__ = "0.1.0"
