"""Sharding actions: the one vocabulary of every plan. A tactic of a schedule, a composite seed and a searched
plan are all lists of these, replayed the same way (`ShardingState.apply`).

- `Tile(target, dim, axis)`: tile a value (or every member of a group) along `dim` over `axis`, and
  propagate;
- `TileLate(target, dim, axis)`: the same tile, placed after the inputs' tiles in a plan's canonical order
  (the search's storage decision, `search/space.py`);
- `Replicate(target, axis)`: forbid sharding `target` on `axis` (propagation stops there);
- `ShardOptimizer(target, dim, axis, stage)`: ZeRO for one parameter group, or with target `*` for every
  parameter (each on its first dim that divides): stage 1 its optimizer states, 2 also its gradient, 3 also
  the parameter itself, with the forward and backward fenced on `axis` (`propagate/zero.py`).

A target is a value name or a group key (`h.*.attn.c_attn.weight`): one action on a group addresses all
its members. Actions are frozen and ordered so the search can hash and sort states; `str(action)` is the
text a plan saves and `tactics.schedule.parse_decision` reads back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Tile:
    target: str
    dim: int
    axis: str

    def __str__(self) -> str:
        return f"tile({self.target}, {self.dim}, {self.axis})"


@dataclass(frozen=True, order=True)
class TileLate:
    """A parameter group's tile applied after the inputs' tiles (with the ZeRO moves, `search.space.rank` 2).
    Where an input's tile has already decided a layer's ops on the axis, the parameter is then only stored
    sharded: gathered where it is used, while propagation carries the tiling on into its gradient's producers
    and its optimizer update (unlike the stage-3 ZeRO move, which fences them); where it has not, it is `Tile`."""

    target: str
    dim: int
    axis: str

    def __str__(self) -> str:
        return f"tile({self.target}, {self.dim}, {self.axis}, late)"


@dataclass(frozen=True, order=True)
class Replicate:
    """Forbid sharding `target` on `axis`: propagation stops there."""

    target: str
    axis: str

    def __str__(self) -> str:
        return f"replicate({self.target}, {self.axis})"


@dataclass(frozen=True, order=True)
class ShardOptimizer:
    """ZeRO for one parameter (group), or every parameter (`target` `*`, `dim` -1: each on its first dim that
    divides): its optimizer states (stage 1), its gradient (2) and the parameter (3) tiled on `dim`."""

    target: str  # a parameter name, a group key, or "*"
    dim: int
    axis: str
    stage: int = 1

    def __str__(self) -> str:
        return f"zero{self.stage}({self.target}, {self.dim}, {self.axis!r})"


Action = Tile | TileLate | Replicate | ShardOptimizer


_TILE = re.compile(r"tile\((?P<target>.+), (?P<dim>-?\d+), (?P<axis>[^,()]+)(?P<late>, late)?\)")
_REPLICATE = re.compile(r"replicate\((?P<target>.+), (?P<axis>[^,()]+)\)")
_ZERO = re.compile(r"zero(?P<stage>\d)\((?P<target>.+), (?P<dim>-?\d+), '(?P<axis>[^']+)'\)")


def parse_action(text: str) -> Action:
    """An action back from its text (`str(action)`, as a plan saves its decisions and the search its log)."""
    if m := _TILE.fullmatch(text):
        return (TileLate if m["late"] else Tile)(m["target"], int(m["dim"]), m["axis"])
    if m := _ZERO.fullmatch(text):
        return ShardOptimizer(m["target"], int(m["dim"]), m["axis"], int(m["stage"]))
    if m := _REPLICATE.fullmatch(text):
        return Replicate(m["target"], m["axis"])
    raise ValueError(f"not an action: {text!r} (expected tile(target, dim, axis[, late]), replicate(target, axis) "
                     "or zeroN(target, dim, 'axis'))")
