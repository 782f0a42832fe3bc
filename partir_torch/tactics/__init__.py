"""Tactics and schedules: the expert strategies (`experts.py`) and how a schedule of tactics is read,
applied and replayed (`schedule.py`)."""

from partir_torch.tactics.experts import (
    FSDP,
    BatchParallel,
    Manual,
    Megatron,
    ZeRO,
    linears,
    megatron_pairs,
)
from partir_torch.tactics.schedule import (
    Context,
    ScheduleError,
    Tactic,
    apply_schedule,
    parse_schedule,
    register_tactic,
    registered_tactics,
    wants_fallback,
    warn_fallbacks,
    warn_misplaced,
)

__all__ = ["FSDP", "BatchParallel", "Context", "Manual", "Megatron", "ScheduleError", "Tactic", "ZeRO",
           "apply_schedule", "linears", "megatron_pairs", "parse_schedule", "register_tactic", "registered_tactics",
           "wants_fallback", "warn_fallbacks", "warn_misplaced"]
