"""An abstract device mesh: named axes with sizes, no devices.

Search and cost analysis see only this (plus per-axis bandwidths from a hardware preset); device ids
appear only when a backend applies a plan.

>>> m = Mesh.parse("batch=2,model=4")
>>> str(m), m.size("model"), m.devices
('Mesh{batch:2, model:4}', 4, 8)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from partir_torch.errors import MeshError


@dataclass(frozen=True)
class Mesh:
    axes: tuple[tuple[str, int], ...]
    # read in propagation's inner loop: axis -> size, and axes -> tile count, computed once / on first use
    _sizes: dict = field(init=False, repr=False, compare=False, hash=False)
    _tiles: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sizes", dict(self.axes))
        object.__setattr__(self, "_tiles", {})
        seen = set()
        for name, size in self.axes:
            if not name.isidentifier():
                raise MeshError(f"mesh axis name {name!r} must be an identifier (e.g. 'batch', 'model')")
            if name in seen:
                raise MeshError(f"mesh axis {name!r} appears twice in {dict(self.axes)}")
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes are positive integers")
            seen.add(name)

    @classmethod
    def of(cls, axes: Mapping[str, int]) -> Mesh:
        return cls(tuple((str(k), int(v)) for k, v in axes.items()))

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """`"batch=2,model=4"`, the CLI's form."""
        axes = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().isdigit():
                raise MeshError(f"mesh entry {part!r} is not axis=size (e.g. --mesh batch=2,model=4)")
            axes.append((name.strip(), int(size)))
        if not axes:
            raise MeshError(f"empty mesh {text!r}; write e.g. batch=2,model=4")
        return cls(tuple(axes))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def devices(self) -> int:
        return math.prod(s for _, s in self.axes)

    def size(self, axis: str) -> int:
        size = self._sizes.get(axis)
        if size is not None:
            return size
        raise MeshError(f"unknown mesh axis {axis!r}; this mesh has axes {list(self.names)}")

    def tile_count(self, axes: tuple[str, ...]) -> int:
        """The product of `axes`' sizes (`sharding.tile_count`), memoized per tuple of axes."""
        k = self._tiles.get(axes)
        if k is None:
            k = 1
            for a in axes:
                k *= self.size(a)
            self._tiles[axes] = k
        return k

    def __str__(self) -> str:
        return "Mesh{" + ", ".join(f"{n}:{s}" for n, s in self.axes) + "}"


def parse_mesh(spec: Mesh | Mapping[str, int] | str) -> tuple[Mesh, frozenset[str]]:
    """A mesh as users write it (`{"batch": 2, "model": 4}`, `"batch=4:dcn,model=8"` or a `Mesh`) and its
    axes marked `:dcn` (slow, cross-slice or cross-node links)."""
    if isinstance(spec, Mesh):
        return spec, frozenset()
    if isinstance(spec, Mapping):
        return Mesh.of(spec), frozenset()
    if not isinstance(spec, str):
        raise MeshError(f"a mesh is a dict like {{'batch': 2, 'model': 4}}, a text like 'batch=2,model=4' or a "
                        f"Mesh, got {type(spec).__name__}")
    dcn, parts = set(), []
    for part in spec.split(","):
        name, _, flag = part.partition(":")
        if flag:
            if flag.strip().isdigit():
                raise MeshError(f"mesh axis {part.strip()!r}: an axis's size follows '=', not ':'; write "
                                f"'{name.strip()}={flag.strip()}' (':dcn' after the size marks a cross-node axis)")
            if flag.strip().lower() not in ("dcn", "ib"):
                raise MeshError(f"mesh axis flag {flag!r} in {part!r}; the only flag is :dcn (slow, cross-node axis)")
            dcn.add(name.split("=")[0].strip())
        parts.append(name)
    return Mesh.parse(",".join(parts)), frozenset(dcn)


def check_devices(mesh: Mesh, devices: int | None) -> None:
    """A mesh must span exactly the devices it is planned for (`--devices N`, `search(devices=N)`)."""
    if devices is None or mesh.devices == devices:
        return
    sizes = " x ".join(str(s) for _, s in mesh.axes)
    raise MeshError(f"mesh {mesh} spans {mesh.devices} devices ({sizes}), but {devices} devices were given; "
                    f"make the product of the axis sizes {devices} (e.g. change one axis), or give --devices "
                    f"{mesh.devices}")
