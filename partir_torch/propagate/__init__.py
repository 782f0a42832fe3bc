"""Propagation: the sharding state of one program on one mesh, its actions applied and propagated to a
fixpoint per axis (`state.py`), the ZeRO action's fences and tiles (`zero.py`)."""

from partir_torch.propagate.state import MOVES, SUMS_PASS, Changes, Conflict, ShardingState, program_rules
from partir_torch.propagate.zero import fits, zero_all

__all__ = ["MOVES", "SUMS_PASS", "Changes", "Conflict", "ShardingState", "fits", "program_rules", "zero_all"]
