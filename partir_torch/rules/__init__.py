"""Tile-mapping rules, one file per op family, registered into one table keyed by aten op."""

from partir_torch.rules.base import MissingRuleError, OpRule, TMap, register, registered, rule_for, rule_name

__all__ = ["MissingRuleError", "OpRule", "TMap", "register", "registered", "rule_for", "rule_name"]
