"""Cost analysis: hardware presets and the cost of a partitioned program (compute, communication, memory)."""

from partir_torch.cost.hardware import PRESETS, Hardware, HardwareError, hardware
from partir_torch.cost.model import CostReport, collective_time, evaluate

__all__ = ["PRESETS", "CostReport", "Hardware", "HardwareError", "collective_time", "evaluate", "hardware"]
