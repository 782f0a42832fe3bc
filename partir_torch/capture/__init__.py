"""Capture: a model's whole training step as a functional aten program on fake tensors."""

from partir_torch.capture.optim import OptimizerSpec, optimizer_spec
from partir_torch.capture.trace import capture

__all__ = ["OptimizerSpec", "capture", "optimizer_spec"]
