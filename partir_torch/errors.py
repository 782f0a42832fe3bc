"""Typed errors. Each message names the offending thing and says what to change."""

from __future__ import annotations


class PartirError(Exception):
    """Base of every error partir_torch raises on purpose."""


class CaptureError(PartirError):
    """The training step could not be captured as an aten graph."""


class UnsupportedOptimizerError(CaptureError):
    """The optimizer (or one of its options) has no functional update here."""


class InputShapeError(CaptureError):
    """The example inputs do not fit the model."""


class MeshError(PartirError):
    """A mesh or a mesh axis is malformed or unknown."""


class IllegalActionError(PartirError):
    """A sharding action cannot apply: the axis is used already, the dim does not divide, and so on.

    The search skips actions that raise this; users see it for bad manual specs.
    """
