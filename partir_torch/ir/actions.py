"""Sharding actions, the moves of the search: `Tile(target, dim, axis)` and `Replicate(target, axis)`.

A target is a value name or a group key (`h.*.attn.c_attn.weight`): one action on a group addresses all
its members. Actions are frozen and ordered so the search can hash and sort states.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Tile:
    target: str
    dim: int
    axis: str

    def __str__(self) -> str:
        return f"tile({self.target}, {self.dim}, {self.axis})"


@dataclass(frozen=True, order=True)
class Replicate:
    """Forbid sharding `target` on `axis`: propagation stops there."""

    target: str
    axis: str

    def __str__(self) -> str:
        return f"replicate({self.target}, {self.axis})"


Action = Tile | Replicate
