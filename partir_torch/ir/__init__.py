"""The partitioning IR: the captured program (values, ops, groups), meshes, shardings and actions."""

from partir_torch.ir.actions import Action, Replicate, ShardOptimizer, Tile, TileLate, parse_action
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Group, Loop, Op, Phase, Program, Ref, Role, Value
from partir_torch.ir.sharding import Sharding

__all__ = ["Action", "Group", "Loop", "Mesh", "Op", "Phase", "Program", "Ref", "Replicate", "Role", "ShardOptimizer",
           "Sharding", "Tile", "TileLate", "Value", "parse_action"]
