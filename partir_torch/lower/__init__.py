"""Lowering: the collectives of a sharding state (`collectives.py`: between the sharding each value has and
the one each op needs, bytes per device, deduplicated) and the walk between two shardings as steps on a
layout (`layout.py`: what `transitions` counts and the torch backend runs)."""

from partir_torch.lower.collectives import (
    Collective,
    dedup_key,
    end_reshards,
    fused,
    local_numel,
    lower,
    made_by_reduction,
    misplaced_reads,
    op_needs,
    op_reshards,
    op_shardings,
    op_signatures,
    pull_back,
    relayout_root,
    relayouts,
    required_operand,
    reshard,
    summarize,
    transitions,
)
from partir_torch.lower.layout import Layout, Step, count, misplaced, walk

__all__ = ["Collective", "Layout", "Step", "count", "dedup_key", "end_reshards", "fused", "local_numel", "lower",
           "made_by_reduction", "misplaced", "misplaced_reads", "op_needs", "op_reshards", "op_shardings",
           "op_signatures", "pull_back", "relayout_root", "relayouts", "required_operand", "reshard", "summarize",
           "transitions", "walk"]
