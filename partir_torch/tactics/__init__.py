"""Tactics and schedules: the expert strategies as functions from a state to their actions (`experts.py`) and
how a schedule of tactics is read, applied and replayed (`schedule.py`)."""

from partir_torch.tactics.experts import (
    FSDP,
    HSDP,
    BatchParallel,
    ExpertParallel,
    Manual,
    Megatron,
    SequenceParallel,
    ZeRO,
    batch_tiles,
    expert_weights,
    group_of,
    linears,
    megatron_pairs,
    megatron_tiles,
)
from partir_torch.tactics.schedule import (
    Context,
    ScheduleError,
    Tactic,
    apply_schedule,
    parse_schedule,
    register_tactic,
    registered_tactics,
    take,
    wants_fallback,
    warn_fallbacks,
    warn_misplaced,
)

__all__ = ["FSDP", "HSDP", "BatchParallel", "Context", "ExpertParallel", "Manual", "Megatron", "ScheduleError",
           "SequenceParallel", "Tactic", "ZeRO", "apply_schedule", "batch_tiles", "expert_weights", "group_of",
           "linears", "megatron_pairs", "megatron_tiles", "parse_schedule", "register_tactic", "registered_tactics",
           "take", "wants_fallback", "warn_fallbacks", "warn_misplaced"]
