"""The partitioning IR: the captured program (values, ops, groups)."""

from partir_torch.ir.program import Group, Op, Phase, Program, Ref, Role, Value

__all__ = ["Group", "Op", "Phase", "Program", "Ref", "Role", "Value"]
