"""partir_torch: automatic SPMD partitioning of PyTorch training steps (after PartIR).

Pipeline: capture -> ir -> rules -> propagate/lower -> cost -> search -> plan -> backends.
"""

from partir_torch.capture import capture
from partir_torch.errors import CaptureError, InputShapeError, PartirError, UnsupportedOptimizerError
from partir_torch.ir import Group, Op, Phase, Program, Role, Value

__all__ = [
    "CaptureError",
    "Group",
    "InputShapeError",
    "Op",
    "PartirError",
    "Phase",
    "Program",
    "Role",
    "UnsupportedOptimizerError",
    "Value",
    "capture",
]
__version__ = "0.1.0"
